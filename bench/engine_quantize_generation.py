"""Generation precision: speed of bf16 and dynamic int8 against fp32, and greedy-token agreement.

Speed: tokens/s of 16 concurrent streaming clients against an engine process per setting.
Fidelity: greedy tokens of fixed prompts, in process, compared with fp32 position by position and
as the share of the sequence generated before the first difference. Run:
    flock /tmp/tidegate-bench.lock python bench/engine_quantize_generation.py [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp

from tidegate.engine.benchkit import engine_process, stream_completion
from tidegate.engine.kv_cache import BlockManager
from tidegate.engine.models import load_model
from tidegate.engine.runner import ModelRunner, RunnerConfig
from tidegate.engine.scheduler import Scheduler, SchedulerConfig
from tidegate.engine.sequence import SamplingParams, Sequence

MODEL = "tiny-random-llama"
SETTINGS = {"fp32": ["--dtype", "fp32"], "bf16": ["--dtype", "bf16"], "int8": ["--quantize", "int8"]}


def prompts(count: int) -> list[str]:
    return [f"Prompt {i:02d}: the tide comes in and the tide goes out." for i in range(count)]


async def tokens_per_s(base: str, clients: int, max_tokens: int) -> float:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        bodies = [{"model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
                  for p in prompts(clients)]
        await stream_completion(session, base, {**bodies[0], "max_tokens": 4})
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_completion(session, base, b) for b in bodies))
        return sum(r.completion_tokens for r in results) / (time.perf_counter() - start)


def greedy_tokens(setting: str, threads: int, count: int, max_tokens: int) -> list[list[int]]:
    loaded = load_model(MODEL)
    dtype = "bf16" if setting == "bf16" else "fp32"
    runner = ModelRunner(loaded, RunnerConfig(kv_cache_tokens=8192, dtype=dtype, threads=threads,
                                              quantize="int8" if setting == "int8" else None))
    scheduler = Scheduler(SchedulerConfig(max_batch_tokens=4096), BlockManager(8192))
    seqs = [Sequence(seq_id=i, prompt_token_ids=loaded.tokenizer.encode(p),
                     params=SamplingParams(max_tokens, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts(count))]
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work:
        batch = scheduler.schedule()
        scheduler.update(batch, runner.run(batch))
    return [seq.output_token_ids for seq in seqs]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(share of positions equal, mean share generated before the first difference)."""
    same = sum(a == b for ref, out in zip(reference, other) for a, b in zip(ref, out))
    total = sum(len(ref) for ref in reference)
    prefixes = []
    for ref, out in zip(reference, other):
        first_diff = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref))
        prefixes.append(first_diff / len(ref))
    return same / total, sum(prefixes) / len(prefixes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    speed = {}
    for setting, flags in SETTINGS.items():
        with engine_process(["--model", MODEL, "--threads", str(args.threads), *flags]) as base:
            speed[setting] = asyncio.run(tokens_per_s(base, args.clients, args.max_tokens))
    tokens = {s: greedy_tokens(s, args.threads, args.clients, args.max_tokens) for s in SETTINGS}
    print(f"model {MODEL}, threads {args.threads}, {args.clients} streaming clients x {args.max_tokens} tokens")
    for setting in SETTINGS:
        positions, prefix = agreement(tokens["fp32"], tokens[setting])
        print(f"{setting:5s}: {speed[setting]:7.1f} tokens/s = {speed[setting] / speed['fp32']:.2f}x fp32; "
              f"greedy agreement with fp32: {positions:.1%} of positions, {prefix:.1%} before first difference")


if __name__ == "__main__":
    main()
