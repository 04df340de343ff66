"""`tidegate sim calibrate`: measure a running engine's step times from outside, fit a profile.

Works against any OpenAI-compatible server that streams `/v1/completions` and takes a prompt as
token ids (the embedded engine, vLLM, SGLang): each prompt is random token ids (from 10 to 249, in
every vocabulary, the embedded engine's 259 byte tokens included), so a prefix cache cannot make a
repeat look cheap, and `ignore_eos` makes every stream as long as asked.
- prefill: each prompt length of the grid sent alone, `repeats` times; its TTFT (median);
- decode: B streams sent together at each batch size and context of the grid; once every one has
  its first token and before any ends, the gap between two tokens is one decode step of batch B
  (their mean with the slowest and fastest tenth left out: a short probe's one hiccup moved a
  plain mean by 25 %).
Several URLs are measured at once, shape by shape, and their samples averaged: replicas that share
a host (cores, memory bandwidth) slow each other down, and a profile of one replica measured alone
would model them faster than they run together.
The fit and its held-out error are `sim.costfit`'s.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import statistics
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from tidegate.engine.benchkit import StreamResult, stream_completion
from tidegate.engine.scheduler import SchedulerConfig
from tidegate.sim.costfit import (DecodeSample, PrefillSample, StepSample, fit_with_held_out, logged_step_s,
                                  read_step_log)
from tidegate.sim.profile import ReplicaProfile
from tidegate.sim.replica import StepCostModel
from tidegate.sim.step_noise import NoiseFit, fit_step_noise, residuals

__all__ = ["CalibrationGrid", "measure", "calibrate", "calibrate_from_step_logs", "read_step_logs", "step_noise_of_logs"]


@dataclass(frozen=True, slots=True)
class CalibrationGrid:
    prompt_tokens: tuple[int, ...] = (8, 32, 64, 96, 160, 256, 384)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    contexts: tuple[int, ...] = (16, 256)
    decode_tokens: int = 24  # generated per stream in a decode measurement
    repeats: int = 3


async def _stream(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                  max_tokens: int) -> StreamResult:
    return await stream_completion(session, url, {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  "ignore_eos": True, "temperature": 0})


async def measure(urls: Sequence[str], model: str, grid: CalibrationGrid = CalibrationGrid(), *,
                  max_batch_tokens: int, seed: int = 0, token_range: tuple[int, int] = (10, 250),
                  progress: Callable[[str], None] = lambda _: None) -> list[PrefillSample | DecodeSample]:
    """The grid's samples, ordered by shape (prefills by length, then decodes by batch and context),
    each shape measured on every URL at once and averaged over them."""
    rng = np.random.default_rng(seed)

    def prompt(tokens: int) -> list[int]:
        return [int(t) for t in rng.integers(*token_range, size=tokens)]

    async def ttft_s(session: aiohttp.ClientSession, url: str, tokens: int) -> float:
        ttfts = []
        for _ in range(grid.repeats):
            stream = await _stream(session, url, model, prompt(tokens), 1)
            _check_prompt(stream, tokens)
            ttfts.append(stream.token_times_s[0] - stream.start_s)
        return statistics.median(ttfts)

    samples: list[PrefillSample | DecodeSample] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(_stream(session, url, model, prompt(8), 2) for url in urls))  # warm up
        for tokens in grid.prompt_tokens:
            each = await asyncio.gather(*(ttft_s(session, url, tokens) for url in urls))
            samples.append(PrefillSample(tokens, statistics.fmean(each)))
            progress(f"prefill {tokens} tokens: TTFT {samples[-1].ttft_s * 1000:.1f} ms")
        for context in grid.contexts:
            for batch in grid.batches:
                # every stream must still decode once the last one's prompt is in: the prompts go
                # through the token budget one after another first
                tokens = grid.decode_tokens + -(-batch * context // max_batch_tokens) + batch
                each = await asyncio.gather(*(_decode(session, url, model, [prompt(context) for _ in range(batch)],
                                                      tokens) for url in urls))
                samples.append(DecodeSample(batch, statistics.fmean(d.context_tokens for d in each),
                                            statistics.fmean(d.step_s for d in each)))
                progress(f"decode batch {batch} at context {context}: step {samples[-1].step_s * 1000:.1f} ms")
    return samples


async def _decode(session: aiohttp.ClientSession, url: str, model: str, prompts: Sequence[list[int]],
                  decode_tokens: int) -> DecodeSample:
    streams = await asyncio.gather(*(_stream(session, url, model, p, decode_tokens) for p in prompts))
    for stream, p in zip(streams, prompts):
        _check_prompt(stream, len(p))
        if len(stream.token_times_s) < decode_tokens:
            raise RuntimeError(f"{url}: a stream ended after {len(stream.token_times_s)} of {decode_tokens} tokens "
                               "(does the server honour ignore_eos?)")
    all_started_s = max(s.token_times_s[0] for s in streams)
    first_end_s = min(s.token_times_s[-1] for s in streams)
    gaps, positions = [], []
    for stream in streams:
        times = stream.token_times_s
        for index in range(1, len(times)):
            if times[index - 1] >= all_started_s and times[index] <= first_end_s:
                gaps.append(times[index] - times[index - 1])
                positions.append(index)
    if len(gaps) < 3:
        raise RuntimeError("too few steps with every stream decoding: raise decode_tokens")
    context = len(prompts[0]) + float(np.mean(positions))
    gaps.sort()
    trim = len(gaps) // 10
    return DecodeSample(len(prompts), context, statistics.fmean(gaps[trim:len(gaps) - trim]))


def _check_prompt(stream: StreamResult, tokens: int) -> None:
    if not stream.token_times_s:
        raise RuntimeError("the server streamed no token")
    if stream.prompt_tokens and stream.prompt_tokens != tokens:
        raise RuntimeError(f"sent {tokens} prompt token ids, the server counted {stream.prompt_tokens}")


def _server_limits(url: str, model: str) -> dict[str, Any]:
    """The scheduler limits the server's /v1/models card states for the model (the embedded engine
    states them; other servers do not, and their values come from the caller)."""
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
            cards = json.loads(response.read()).get("data", [])
    except (OSError, ValueError):
        return {}
    card = next((c for c in cards if isinstance(c, dict) and c.get("id") == model), {})
    return {key: card[key] for key in ("max_num_seqs", "max_batch_tokens", "kv_cache_tokens", "attention_cost_tokens")
            if key in card}


def calibrate(urls: Sequence[str], model: str, *, name: str, description: str, max_num_seqs: int | None = None,
              max_batch_tokens: int | None = None, kv_cache_tokens: int | None = None,
              attention_cost_tokens: int | None = None, cold_start_s: float = 0.0,
              grid: CalibrationGrid = CalibrationGrid(), seed: int = 0,
              progress: Callable[[str], None] = lambda _: None) -> ReplicaProfile:
    """Measures the servers at `urls` (replicas of one engine) and returns their fitted profile,
    with its held-out error. Limits not given are read from the server's model card, else the
    embedded engine's defaults."""
    stated = _server_limits(urls[0], model)
    defaults = SchedulerConfig()
    max_num_seqs = max_num_seqs or stated.get("max_num_seqs", defaults.max_num_seqs)
    max_batch_tokens = max_batch_tokens or stated.get("max_batch_tokens", defaults.max_batch_tokens)
    kv_cache_tokens = kv_cache_tokens or stated.get("kv_cache_tokens", 32768)
    attention_cost_tokens = attention_cost_tokens or stated.get("attention_cost_tokens")
    progress(f"limits: {max_num_seqs} sequences, {max_batch_tokens} tokens a step, {kv_cache_tokens} KV tokens, "
             f"attention cost tokens {attention_cost_tokens} ({'stated by the server' if stated else 'given'})")
    samples = asyncio.run(measure(urls, model, grid, max_batch_tokens=max_batch_tokens, seed=seed, progress=progress))
    fit, error = fit_with_held_out(samples, max_batch_tokens, attention_cost_tokens)
    return ReplicaProfile(name, description, estimate=False,
                          sources=(f"tidegate sim calibrate against {model} on {len(urls)} replica(s) at once: "
                                   f"{len(samples)} shapes",),
                          cost=fit.model, max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens,
                          kv_cache_tokens=kv_cache_tokens, cold_start_s=cold_start_s, fit=error,
                          attention_cost_tokens=attention_cost_tokens)


def calibrate_from_step_logs(paths: Sequence[str], *, name: str, description: str, max_num_seqs: int | None = None,
                             max_batch_tokens: int | None = None, kv_cache_tokens: int | None = None,
                             attention_cost_tokens: int | None = None, cold_start_s: float = 0.0,
                             by_rows: bool = True, decode_attention: bool = False,
                             step_noise: bool = False) -> ReplicaProfile:
    """A profile fitted on the steps engines logged while serving (`tidegate engine --step-log`);
    limits not given are the embedded engine's defaults. The steps mix prefill chunks and decodes,
    so they are fitted by the forward pass's rows (`sim.costfit`; `by_rows=False`: by prefill
    tokens and decode batch, as a probe's samples are). `decode_attention`: fit the decode
    attention by the engine's rows x the longest decode context and the prefill chunks' context
    apart (by rows, on logs that carry the attention's shape). Off by default: on the served steps
    of the fidelity loads it predicted held-out shapes no better than the summed context does
    (docs/simulator.md, "The decode step's attention"). `step_noise`: fit how the steps vary around
    the fitted mean, in time (`sim.step_noise`), into the profile's `noise`."""
    logs = read_step_logs(paths)
    steps = [step for log in logs for step in log]
    if len(steps) < 30:
        raise ValueError(f"{len(steps)} logged steps: too few to fit a profile")
    defaults = SchedulerConfig()
    max_batch_tokens = max_batch_tokens or defaults.max_batch_tokens
    # held out every third step of a log ordered by shape, so each shape has some held out
    steps.sort(key=lambda s: s.shape)
    fit, error = fit_with_held_out(steps, max_batch_tokens, attention_cost_tokens, by_rows, decode_attention)
    noise = step_noise_of_logs(logs, fit.model).noise if step_noise else None
    return ReplicaProfile(name, description, estimate=False,
                          sources=(f"tidegate sim calibrate --step-log: {len(steps)} steps logged while serving, "
                                   f"from {len(paths)} log(s)",),
                          cost=fit.model, max_num_seqs=max_num_seqs or defaults.max_num_seqs,
                          max_batch_tokens=max_batch_tokens, kv_cache_tokens=kv_cache_tokens or 32768,
                          cold_start_s=cold_start_s, fit=error, attention_cost_tokens=attention_cost_tokens,
                          noise=noise)


def read_step_logs(paths: Sequence[str]) -> list[list[StepSample]]:
    """Each engine's step log (`tidegate engine --step-log`, .csv or .csv.gz) as its steps."""
    logs = []
    for path in paths:
        # gzip'd as kept beside a profile (bench/data/calibration), else as the engine writes it
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as handle:
            logs.append(read_step_log(handle))
    return logs


def step_noise_of_logs(logs: Sequence[Sequence[StepSample]], model: StepCostModel) -> NoiseFit:
    """The step noise of logged steps (one list an engine) around what `model` predicts for each."""
    return fit_step_noise([(np.array([s.start_s for s in log]),
                            residuals([logged_step_s(model, s) for s in log], [s.step_s for s in log]))
                           for log in logs])
