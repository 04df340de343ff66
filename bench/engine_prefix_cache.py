"""Prefix caching: TTFT and prefill work of many tenants' requests, each behind its own long system prompt.

8 tenants, each with its own ~1,000-token system prompt; requests round-robin over the tenants,
each its tenant's system prompt and a short user turn of its own, arrive at a steady rate. One
engine in this process (tiny-random-llama, the scheduler and runner `tidegate engine` builds,
driven step by step from here) serves the same arrivals twice, prefix caching on and off. Prints
P50/P99 time to first token (arrival to the end of the step that sampled it), the prompt tokens
the engine computed, the hit rate, and off/on ratios. Under 2 minutes with the defaults. Run:
    flock /tmp/tidegate-bench.lock python bench/engine_prefix_cache.py [--requests 24] [--rate 1.0] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import numpy as np

from tidegate.engine.kv_cache import BlockManager
from tidegate.engine.models import load_model
from tidegate.engine.runner import ModelRunner, RunnerConfig
from tidegate.engine.scheduler import Scheduler, SchedulerConfig
from tidegate.engine.sequence import SamplingParams, Sequence

MODEL = "tiny-random-llama"
KV_CACHE_TOKENS = 32768  # `tidegate engine`'s default: room for every tenant's system prompt
TENANTS = 8


@dataclass(frozen=True)
class Arrival:
    at_s: float
    tenant: int
    prompt: list[int]


@dataclass(frozen=True)
class RunResult:
    ttfts_s: list[float]
    prefill_tokens: int  # prompt tokens computed (a cached prefix is not)
    prompt_tokens: int  # prompt tokens submitted
    hit_rate: float  # cached tokens found / prompt tokens looked up
    wall_s: float


def workload(requests: int, rate_per_s: float, system_tokens: int, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    # byte-level token ids of printable text, as the preset's tokenizer would give
    systems = [[rng.randrange(32, 127) for _ in range(system_tokens + rng.randrange(-50, 50))]
               for _ in range(TENANTS)]
    return [Arrival(i / rate_per_s, i % TENANTS,
                    systems[i % TENANTS] + [rng.randrange(32, 127) for _ in range(rng.randrange(12, 40))])
            for i in range(requests)]


def serve(runner: ModelRunner, config: SchedulerConfig, arrivals: list[Arrival], max_tokens: int) -> RunResult:
    """Serves `arrivals` in real time, one engine step after another, as the engine loop does."""
    scheduler = Scheduler(config, BlockManager(KV_CACHE_TOKENS))
    arrival_s: dict[int, float] = {}
    ttfts_s: list[float] = []
    prefill_tokens = 0
    pending = list(enumerate(arrivals))
    started = time.perf_counter()
    while pending or scheduler.has_work:
        now_s = time.perf_counter() - started
        while pending and pending[0][1].at_s <= now_s:
            seq_id, arrival = pending.pop(0)
            arrival_s[seq_id] = arrival.at_s
            scheduler.add(Sequence(seq_id=seq_id, prompt_token_ids=arrival.prompt,
                                   params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)))
        if not scheduler.has_work:
            time.sleep(pending[0][1].at_s - now_s)
            continue
        batch = scheduler.schedule()
        outputs = scheduler.update(batch, runner.run(batch))
        done_s = time.perf_counter() - started
        prefill_tokens += sum(chunk.num_tokens for chunk in batch.chunks[batch.num_decodes:])
        ttfts_s += [done_s - arrival_s[o.seq_id] for o in outputs if o.num_output_tokens == 1]
    blocks = scheduler.blocks
    hit_rate = blocks.prefix_hit_tokens / blocks.prefix_queried_tokens if blocks.prefix_queried_tokens else 0.0
    return RunResult(ttfts_s, prefill_tokens, sum(len(a.prompt) for a in arrivals), hit_rate,
                     time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second, evenly spaced")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    runner = ModelRunner(load_model(MODEL), RunnerConfig(kv_cache_tokens=KV_CACHE_TOKENS, threads=args.threads))
    arrivals = workload(args.requests, args.rate, args.system_tokens)
    results = {}
    for caching in (True, False):
        # the engine's own defaults (max_batch_tokens 96, chunked prefill charged for attention)
        config = SchedulerConfig(attention_cost_tokens=runner.model.attention_cost_tokens(),
                                 enable_prefix_caching=caching)
        serve(runner, config, workload(2, 100.0, 32, seed=1), max_tokens=2)  # warm-up: kernels, mirror
        results[caching] = serve(runner, config, arrivals, args.max_tokens)
    print(f"model {MODEL}, threads {args.threads}: {args.requests} requests at {args.rate:g}/s round-robin over "
          f"{TENANTS} tenants, each a ~{args.system_tokens}-token system prompt + a 12-39-token user turn, "
          f"{args.max_tokens} tokens out; the first request of each tenant finds nothing cached")
    for caching, result in results.items():
        p50, p99 = np.percentile(result.ttfts_s, [50, 99]) * 1000
        share = result.prefill_tokens / result.prompt_tokens
        print(f"prefix caching {'on ' if caching else 'off'}: TTFT P50 {p50:7.0f} ms  P99 {p99:7.0f} ms; "
              f"prompt tokens computed {result.prefill_tokens:6d} of {result.prompt_tokens} ({share:.0%}); "
              f"hit rate {result.hit_rate:.1%}; {result.wall_s:.1f} s")
    on, off = results[True], results[False]
    on_p50, on_p99 = np.percentile(on.ttfts_s, [50, 99])
    off_p50, off_p99 = np.percentile(off.ttfts_s, [50, 99])
    print(f"off / on: TTFT P50 {off_p50 / on_p50:.1f}x, P99 {off_p99 / on_p99:.1f}x; "
          f"prompt tokens computed {off.prefill_tokens / on.prefill_tokens:.1f}x")


if __name__ == "__main__":
    main()
