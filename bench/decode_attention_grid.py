"""What a batched decode step costs by its decodes and their contexts, timed in process.

    python bench/decode_attention_grid.py [--steps 12] [--threads 1]

The engine's decode attention reads its decode mirror (`engine/decode_mirror.py`): every decoding
sequence's row up to the step's longest context, the rest of a row masked, so a step of B decodes
should cost as B x the longest context, whatever the others' contexts. Past the mirror's budget
(rows rounded up to 8 x the length rounded up to 128 > the KV cache's tokens) it gathers each
decode's blocks instead, padded to the longest context. This times tiny-random-llama's decode steps
(`ModelRunner`, one thread, as the served engines run) with B sequences at one context ("even")
against B sequences of which one has that context and the rest 32 tokens ("one long"): alike if
the cost follows the longest context, apart if it follows the summed one. Prints the median step
of each shape, the path the attention took, and a least-squares line through the "even" steps in
B x context, and what that line predicts for the "one long" steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from tidegate.engine.kv_cache import BlockManager
from tidegate.engine.models import load_model
from tidegate.engine.runner import ModelRunner, RunnerConfig
from tidegate.engine.scheduler import Scheduler, SchedulerConfig
from tidegate.engine.sequence import SamplingParams, Sequence

KV_CACHE_TOKENS = 32768  # the engine server's default, so the mirror's budget is the served one's
SHORT = 32


def decode_steps_s(runner: ModelRunner, contexts: list[int], steps: int) -> tuple[float, str, int]:
    """Median time of `steps` decode steps of sequences with these prompt lengths (prefilled first),
    the attention's path and rows on the last step."""
    config = SchedulerConfig(max_num_seqs=len(contexts), max_batch_tokens=4096, enable_prefix_caching=False)
    scheduler = Scheduler(config, BlockManager(KV_CACHE_TOKENS))
    for index, length in enumerate(contexts):
        scheduler.add(Sequence(seq_id=index, prompt_token_ids=[5 + index % 50] * length,
                               params=SamplingParams(max_tokens=steps + 4, ignore_eos=True)))
    times = []
    while scheduler.has_work:
        batch = scheduler.schedule()
        started = time.perf_counter()
        tokens = runner.run(batch)
        elapsed = time.perf_counter() - started
        if batch.num_decodes == len(contexts) and len(batch.chunks) == len(contexts):
            times.append(elapsed)
        scheduler.update(batch, tokens)
        if len(times) > steps:
            break
    attention = runner.decode_attention
    return statistics.median(times[1:]), attention.path, attention.rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    runner = ModelRunner(load_model("tiny-random-llama"), RunnerConfig(KV_CACHE_TOKENS, threads=args.threads))
    decode_steps_s(runner, [16] * 4, 4)  # warm-up
    rows = []
    print(f"{'decodes':>7} {'longest':>7} {'shape':>8} {'ms':>7} {'path':>6} {'rows':>4}")
    for batch in (1, 4, 8, 16, 24, 32, 40):
        for longest in (64, 256, 512, 896):
            for shape in ("even", "one long"):
                if shape == "one long" and batch == 1:
                    continue
                contexts = [longest] * batch if shape == "even" else [longest] + [SHORT] * (batch - 1)
                if sum(contexts) + batch * (args.steps + 8) > KV_CACHE_TOKENS:
                    continue
                step_s, path, used_rows = decode_steps_s(runner, contexts, args.steps)
                rows.append((batch, longest, shape, step_s, path, sum(contexts)))
                print(f"{batch:>7} {longest:>7} {shape:>8} {step_s * 1000:>7.1f} {path:>6} {used_rows:>4}", flush=True)
    even = [(b, l, s) for b, l, shape, s, path, _ in rows if shape == "even" and path == "mirror"]
    design = np.array([[1.0, b, b * l] for b, l, _ in even])
    coefficients, *_ = np.linalg.lstsq(design, np.array([s for *_, s in even]), rcond=None)
    base, per_decode, per_position = coefficients
    print(f"\neven, mirror: step = {base * 1000:.1f} ms + {per_decode * 1e6:.0f} us x decodes "
          f"+ {per_position * 1e9:.0f} ns x decodes x longest context")
    print("one long against that line, by decodes x longest and by the summed context (B x 32 + longest):")
    for b, l, shape, s, path, summed in rows:
        if shape != "one long":
            continue
        by_longest = base + per_decode * b + per_position * b * l
        by_sum = base + per_decode * b + per_position * summed
        print(f"  {b:>3} x {l:>4} ({path}): measured {s * 1000:6.1f} ms, by longest {by_longest * 1000:6.1f} "
              f"({s / by_longest - 1:+.0%}), by sum {by_sum * 1000:6.1f} ({s / by_sum - 1:+.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
