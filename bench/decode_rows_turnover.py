"""Decode throughput when sequences finish at different steps: the decode mirror's row turnover.

    python bench/decode_rows_turnover.py [--sequences 32] [--seconds 20] [--threads 1]

A closed loop in process (`ModelRunner` and `Scheduler`, tiny-random-llama, one thread as the
served engines run): `--sequences` in flight, each with a prompt of 16-256 tokens and 16-64
answered tokens drawn from a fixed seed; one that finishes is replaced some steps later (an
arrival's gap, `--mean-gap-steps`). So decodes leave the batch from anywhere and new ones join a
while after, as in serving. Prints the tokens computed a second, the
decode steps' mean time, and the mirror's rows against the decodes (the attention computes every
row up to the highest in use). Run it against two checkouts in turn (PYTHONPATH) to compare them on
the same machine: the same seed gives both the same requests.
"""

from __future__ import annotations

import argparse
import heapq
import random
import time

from tidegate.engine.kv_cache import BlockManager
from tidegate.engine.models import load_model
from tidegate.engine.runner import ModelRunner, RunnerConfig
from tidegate.engine.scheduler import Scheduler, SchedulerConfig
from tidegate.engine.sequence import SamplingParams, Sequence

KV_CACHE_TOKENS = 32768  # the engine server's default, so the mirror's budget is the served one's


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--mean-gap-steps", type=int, default=8,
                        help="a finished sequence's replacement arrives 1..2x this many steps later")
    args = parser.parse_args()
    runner = ModelRunner(load_model("tiny-random-llama"), RunnerConfig(KV_CACHE_TOKENS, threads=args.threads))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=args.sequences, max_batch_tokens=512,
                                          enable_prefix_caching=False), BlockManager(KV_CACHE_TOKENS))
    draw = random.Random(args.seed)
    next_id = 0

    def add() -> None:
        nonlocal next_id
        prompt = [5 + (next_id * 7 + i) % 50 for i in range(draw.randint(16, 256))]
        scheduler.add(Sequence(seq_id=next_id, prompt_token_ids=prompt,
                               params=SamplingParams(max_tokens=draw.randint(16, 64), ignore_eos=True)))
        next_id += 1

    for _ in range(args.sequences):
        add()
    replacements: list[int] = []  # a heap: the steps at which finished sequences' replacements arrive
    tokens = decode_steps = decodes = rows = step = 0
    decode_s = 0.0
    started = time.perf_counter()
    deadline = started + args.seconds
    while time.perf_counter() < deadline:
        batch = scheduler.schedule()
        step_started = time.perf_counter()
        sampled = runner.run(batch)
        step_s = time.perf_counter() - step_started
        tokens += batch.num_tokens
        attention = runner.decode_attention
        if batch.num_decodes and attention is not None and attention.path == "mirror":
            decode_steps += 1
            decodes += batch.num_decodes
            rows += attention.rows
            decode_s += step_s
        step += 1
        for output in scheduler.update(batch, sampled):
            if output.finish_reason is not None:  # its replacement comes some steps later, as arrivals do
                heapq.heappush(replacements, step + draw.randint(1, 2 * args.mean_gap_steps))
        while replacements and replacements[0] <= step:
            heapq.heappop(replacements)
            add()
    elapsed = time.perf_counter() - started
    print(f"{next_id - args.sequences} requests finished and replaced, {tokens / elapsed:,.0f} tokens computed a second; "
          f"decode steps on the mirror {decode_steps}, mean {decode_s / max(1, decode_steps) * 1000:.1f} ms, "
          f"{decodes / max(1, decode_steps):.1f} decodes and {rows / max(1, decode_steps):.1f} rows a step "
          f"({rows / max(1, decodes):.2f} rows a decode)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
