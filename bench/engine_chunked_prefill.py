"""Chunked prefill keeps streams smooth: while 16 streams decode, a 2,000-token prompt arrives.

Prints the 16 streams' median and largest inter-token gap with chunking on (bar: largest <= 4x
median) and off (the long prefill runs in one step and stalls every stream). Run:
    flock /tmp/tidegate-bench.lock python bench/engine_chunked_prefill.py [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp

from tidegate.engine.benchkit import engine_process, stream_completion

MODEL = "tiny-random-llama"


async def measure(base: str, streams: int, decode_tokens: int, long_prompt_tokens: int) -> tuple[float, float, float]:
    """(median gap s, largest gap s, long prompt's time to first token s) over the streams' steady part."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        body = {"model": MODEL, "max_tokens": decode_tokens, "temperature": 0, "ignore_eos": True}
        tasks = [asyncio.create_task(stream_completion(session, base, {**body, "prompt": f"stream {i:02d}: go"}))
                 for i in range(streams)]
        await asyncio.sleep(1.5)  # every stream admitted and decoding
        steady_from = time.perf_counter()
        long_body = {"model": MODEL, "prompt": "x" * long_prompt_tokens, "max_tokens": 1}
        long_result = await stream_completion(session, base, long_body)
        results = await asyncio.gather(*tasks)
    if any(len(r.token_times_s) < decode_tokens for r in results):
        raise RuntimeError("a stream ended early")
    gaps = [b - a for r in results for a, b in zip(r.token_times_s, r.token_times_s[1:]) if a >= steady_from]
    return statistics.median(gaps), max(gaps), long_result.token_times_s[0] - long_result.start_s


async def warm_up(base: str) -> None:
    async with aiohttp.ClientSession() as session:
        await stream_completion(session, base, {"model": MODEL, "prompt": "x" * 300, "max_tokens": 4})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=300)
    parser.add_argument("--long-prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="engine budget (default: the engine's)")
    parser.add_argument("--trials", type=int, default=3,
                        help="long prompts per engine; the median trial is reported (a largest gap is one sample, "
                             "so one stall of a shared machine would otherwise decide it)")
    args = parser.parse_args()
    common = ["--model", MODEL, "--threads", str(args.threads)]
    if args.max_batch_tokens:
        common += ["--max-batch-tokens", str(args.max_batch_tokens)]
    print(f"model {MODEL}, threads {args.threads}, {args.streams} decoding streams, a "
          f"{args.long_prompt_tokens}-token prompt arrives; max-batch-tokens {args.max_batch_tokens or 'default'}")
    for label, extra in (("chunked prefill on ", []), ("chunked prefill off", ["--no-chunked-prefill"])):
        trials = []
        with engine_process(common + extra) as base:
            asyncio.run(warm_up(base))
            for _ in range(args.trials):
                trials.append(asyncio.run(measure(base, args.streams, args.decode_tokens, args.long_prompt_tokens)))
        trials.sort(key=lambda trial: trial[1] / trial[0])
        median, largest, ttft = trials[len(trials) // 2]
        verdict = "bar <= 4x" if "on" in label else "for comparison"
        every = ", ".join(f"{t[1] / t[0]:.2f}x" for t in trials)
        print(f"{label}: median gap {median * 1000:6.1f} ms, largest {largest * 1000:7.1f} ms = "
              f"{largest / median:5.2f}x median ({verdict}); long prompt TTFT {ttft:.2f} s; trials {every}")


if __name__ == "__main__":
    main()
