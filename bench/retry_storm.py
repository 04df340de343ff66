"""A retry storm, live: closed-loop clients that resend at once on every refusal, against two
embedded engines behind the FIFO gateway and behind tidegate (overload control on), same run.

Why: benchmark tools and naive SDK loops (guidellm, a `while True: try/except` around the client)
ignore `Retry-After` and send again the moment they are refused. A gateway that refuses under
pressure then gets more requests, not fewer; the first cut, tried with guidellm (64 streams, 20 s,
embedded default), completed 30 requests and refused 2,210 with overload control on, against 165
completed with it off. The principle (docs/overload-knobs.md): overload control never serves less
good work than FIFO, and a storm must not collapse what the replicas deliver.

Each arm runs `--clients` closed-loop clients (default 64 and 512) for `--storm-s` seconds over the
same two `tidegate engine` replicas (one torch thread each; the engines, both gateways and this
client share the machine's cores, as they do under `tidegate serve` on a small machine). Every
client sends a streamed chat request (a ~PROMPT-token prompt, TOKENS tokens answered), waits for
its answer, and sends the next; a refusal (429/503) or an error is sent again at once. Counted
when the storm ends, requests still running are cut (their work after the storm counts for nobody).

Prints per arm: completed, completed within the standard tier's TTFT target, refusals received,
other errors, TTFT p50/p99 of the completed, the replicas' busy fraction (engine step time over
wall time, from `tidegate_engine_busy_seconds`) and generated tokens/s.
Bars: tidegate's completed-within-target >= FIFO's (never less good work than FIFO), its completed
>= 0.8x FIFO's (no collapse), and its replicas >= 80 % busy.

Run: flock /tmp/tidegate-bench.lock python bench/retry_storm.py [--clients 64,512] [--storm-s 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overload import gateway_config, start_gateway, start_replicas  # noqa: E402
from overload_measure import EMBEDDED_MODEL, TTFT_TARGET_S, Processes, drain, free_port, http_text  # noqa: E402

# the prompts of a chat benchmark. The embedded model's tokenizer is byte-level: a token a byte (the
# prompt of 250 words this bench first sent was ~1,500 tokens, 6x what it said)
PROMPT_TOKENS = 250
TOKENS = 32
TIER = "standard"  # tenant t1's tier: the storm is ordinary traffic, not the best tier's


@dataclass
class Arm:
    completed: int = 0
    within_target: int = 0
    refused: int = 0
    errors: int = 0
    error_kinds: Counter = field(default_factory=Counter)
    ttfts_s: list[float] = field(default_factory=list)
    started: float = 0.0  # requests the engines started (from their prompt tokens)
    reasons: Counter = field(default_factory=Counter)  # the gateway's refusals by reason


async def client(session: aiohttp.ClientSession, url: str, body: bytes, stop_at: float, arm: Arm) -> None:
    """One closed-loop client: sends, waits for the answer, sends again; a refusal is resent at once."""
    headers = {"Authorization": "Bearer sk-t1", "Content-Type": "application/json"}
    while time.monotonic() < stop_at:
        sent = time.monotonic()
        try:
            async with session.post(url, data=body, headers=headers) as response:
                if response.status in (429, 503):
                    await response.read()
                    arm.refused += 1
                    continue  # ignores Retry-After, as the storm's clients do
                if response.status != 200:
                    await response.read()
                    arm.errors += 1
                    arm.error_kinds[f"HTTP {response.status}"] += 1
                    continue
                first_s = None
                finished = False
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    choice = (event.get("choices") or [{}])[0]
                    if first_s is None and (choice.get("delta") or {}).get("content"):
                        first_s = time.monotonic() - sent
                    finished = finished or choice.get("finish_reason") is not None
                if not finished or first_s is None:
                    arm.errors += 1
                    arm.error_kinds["stream without an answer"] += 1
                    continue
                arm.completed += 1
                arm.ttfts_s.append(first_s)
                arm.within_target += first_s <= TTFT_TARGET_S[TIER]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            arm.errors += 1
            arm.error_kinds[type(error).__name__] += 1


def engine_busy_s(upstreams: list[str]) -> float:
    total = 0.0
    for url in upstreams:
        text = http_text(url.removesuffix("/v1") + "/metrics")
        match = re.search(r"^tidegate_engine_busy_seconds_total (\S+)", text, re.M)
        total += float(match.group(1)) if match else 0.0
    return total


def engine_counter(upstreams: list[str], name: str) -> float:
    total = 0.0
    for url in upstreams:
        text = http_text(url.removesuffix("/v1") + "/metrics")
        for match in re.finditer(rf"^{name}_total(?:\{{[^}}]*\}})? (\S+)", text, re.M):
            total += float(match.group(1))
    return total


def refusal_reasons(gateway: str) -> Counter:
    """The gateway's refusals so far, by reason (overload control's counter; FIFO has none)."""
    reasons: Counter = Counter()
    text = http_text(gateway + "/metrics")
    for match in re.finditer(r'^tidegate_overload_rejections_total\{([^}]*)\} (\S+)', text, re.M):
        reason = re.search(r'reason="([^"]*)"', match.group(1))
        reasons[reason.group(1) if reason else "?"] += int(float(match.group(2)))
    return reasons


async def storm(gateway: str, clients: int, storm_s: float, upstreams: list[str]) -> tuple[Arm, float, float]:
    prompt = ("hello " * PROMPT_TOKENS)[:PROMPT_TOKENS]
    body = json.dumps({"model": "m", "stream": True, "max_tokens": TOKENS, "ignore_eos": True,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    arm = Arm()
    busy_before = engine_busy_s(upstreams)
    generated_before = engine_counter(upstreams, "tidegate_engine_generation_tokens")
    prompts_before = engine_counter(upstreams, "tidegate_engine_prompt_tokens")
    reasons_before = refusal_reasons(gateway)
    started = time.monotonic()
    stop_at = started + storm_s
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [asyncio.create_task(client(session, gateway + "/v1/chat/completions", body, stop_at, arm))
                 for _ in range(clients)]
        await asyncio.wait(tasks, timeout=storm_s)
        for task in tasks:  # the storm is over: what still runs is cut
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.monotonic() - started
    busy = (engine_busy_s(upstreams) - busy_before) / (elapsed * len(upstreams))
    generated = (engine_counter(upstreams, "tidegate_engine_generation_tokens") - generated_before) / elapsed
    # requests the engines started: their prompt tokens over one prompt's (~1 token a word)
    arm.started = (engine_counter(upstreams, "tidegate_engine_prompt_tokens") - prompts_before) / PROMPT_TOKENS
    arm.reasons = refusal_reasons(gateway) - reasons_before
    return arm, busy, generated


def line(name: str, arm: Arm, busy: float, tokens_s: float) -> str:
    p50, p99 = (np.percentile(arm.ttfts_s, [50, 99]) if arm.ttfts_s else (float("nan"),) * 2)
    return (f"  {name:8s} completed {arm.completed:5d}  within {TTFT_TARGET_S[TIER]:.0f} s target {arm.within_target:5d}"
            f"  refused {arm.refused:7,d}  errors {arm.errors:4d}  TTFT p50 {p50:5.2f} s p99 {p99:5.2f} s"
            f"  replicas busy {100 * busy:3.0f} %  generated {tokens_s:5.0f} tok/s"
            + f"\n           engines started ~{arm.started:.0f} requests"
            + (f"; refusals by reason: {dict(arm.reasons.most_common())}" if arm.reasons else "")
            + (f"\n           errors: {dict(arm.error_kinds.most_common(3))}" if arm.errors else ""))


async def run(processes: Processes, client_counts: list[int], storm_s: float) -> bool:
    upstreams = start_replicas(processes, "embedded")
    workdir = Path(tempfile.mkdtemp(prefix="tidegate-storm-"))
    gateways = {mode: start_gateway(processes, workdir, mode,
                                    gateway_config(free_port(), upstreams, mode == "tidegate",
                                                   upstream_model=EMBEDDED_MODEL))
                for mode in ("fifo", "tidegate")}
    print(f"replicas: 2 x `tidegate engine --model {EMBEDDED_MODEL} --threads 1`; prompts ~{PROMPT_TOKENS} tokens, "
          f"{TOKENS} tokens answered; tier {TIER} (TTFT target {TTFT_TARGET_S[TIER]:.0f} s); storm {storm_s:.0f} s an arm")
    ok = True
    for clients in client_counts:
        print(f"{clients} clients resending at once:")
        results = {}
        for mode in ("fifo", "tidegate"):
            results[mode] = await storm(gateways[mode], clients, storm_s, upstreams)
            print(line(mode, *results[mode]), flush=True)
            await asyncio.to_thread(drain, upstreams, 60.0)
        (fifo, _, _), (ours, busy, _) = results["fifo"], results["tidegate"]
        good = ours.within_target >= fifo.within_target and ours.within_target > 0
        kept = ours.completed >= 0.8 * fifo.completed
        busy_ok = busy >= 0.8
        print(f"  bars: within target {ours.within_target} vs FIFO {fifo.within_target} {'PASS' if good else 'FAIL'}; "
              f"completed {ours.completed} vs 0.8 x FIFO {0.8 * fifo.completed:.0f} {'PASS' if kept else 'FAIL'}; "
              f"replicas busy {100 * busy:.0f} % (bar 80 %) {'PASS' if busy_ok else 'FAIL'}")
        ok = ok and good and kept and busy_ok
    print(f"all bars: {'PASS' if ok else 'FAIL'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="64,512", help="comma-separated client counts, one storm each")
    parser.add_argument("--storm-s", type=float, default=40.0)
    args = parser.parse_args()
    processes = Processes()
    try:
        return 0 if asyncio.run(run(processes, [int(c) for c in args.clients.split(",")], args.storm_s)) else 1
    finally:
        processes.stop_all()


if __name__ == "__main__":
    sys.exit(main())
