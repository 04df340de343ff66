"""Continuous batching pays: tokens/s with 32 concurrent streaming clients vs one client, and vs
transformers' `model.generate()` on static batches of 32 of the same prompts (same model, threads).

Bars (issue 2): 32 clients >= 8x one client; engine >= 1.0x generate(). Run:
    flock /tmp/tidegate-bench.lock python bench/engine_batching.py [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aiohttp
import torch

from tidegate.engine.benchkit import engine_process, stream_completion
from tidegate.engine.models import load_model

MODEL = "tiny-random-llama"


def prompts(count: int) -> list[str]:
    # equal byte length, so that generate() needs no padding
    return [f"Request {i:03d}: a story about the sea and a ship." for i in range(count)]


async def clients_tokens_per_s(base: str, concurrency: int, rounds: int, max_tokens: int) -> float:
    texts = prompts(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client(i: int) -> int:
            total = 0
            for _ in range(rounds):
                body = {"model": MODEL, "prompt": texts[i], "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True}
                total += (await stream_completion(session, base, body)).completion_tokens
            return total

        await client(0)  # warm the path
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(client(i) for i in range(concurrency))))
        return tokens / (time.perf_counter() - start)


class StaticBatchGenerate:
    """transformers' generate() on one static batch of the same prompts, in this process."""

    def __init__(self, threads: int, batch: int, max_tokens: int, dtype: torch.dtype) -> None:
        torch.set_num_threads(threads)
        loaded = load_model(MODEL)
        self.model = loaded.hf_model.to(dtype)
        self.ids = torch.tensor([loaded.tokenizer.encode(text) for text in prompts(batch)])
        self.kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                           pad_token_id=loaded.tokenizer.END_OF_TEXT,
                           attention_mask=torch.ones_like(self.ids))
        self.tokens_per_s()  # warm up

    def tokens_per_s(self) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            output = self.model.generate(self.ids, **self.kwargs)
            elapsed = time.perf_counter() - start
        return (output.shape[1] - self.ids.shape[1]) * self.ids.shape[0] / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each is reported")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="engine dtype (default: the engine's)")
    args = parser.parse_args()
    engine_args = ["--model", MODEL, "--threads", str(args.threads)]
    if args.dtype:
        engine_args += ["--dtype", args.dtype]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    one, many, static = [], [], []
    with engine_process(engine_args) as base:
        baseline = StaticBatchGenerate(args.threads, args.clients, args.max_tokens, dtype)
        # interleaved, so that a burst of other load on the machine hits every mode alike
        for _ in range(args.rounds):
            one.append(asyncio.run(clients_tokens_per_s(base, 1, 2, args.max_tokens)))
            many.append(asyncio.run(clients_tokens_per_s(base, args.clients, 1, args.max_tokens)))
            static.append(baseline.tokens_per_s())  # the engine idles meanwhile
    best_one, best_many, best_static = max(one), max(many), max(static)
    print(f"model {MODEL}, threads {args.threads}, engine dtype {args.dtype or 'default'}, "
          f"{args.max_tokens} tokens per request, best of {args.rounds} interleaved rounds")
    print(f"1 streaming client:          {best_one:8.1f} tokens/s  (rounds: {_fmt(one)})")
    print(f"{args.clients} streaming clients:        {best_many:8.1f} tokens/s  (rounds: {_fmt(many)})")
    print(f"generate(), static batch {args.clients}: {best_static:8.1f} tokens/s  (rounds: {_fmt(static)})")
    print(f"{args.clients} clients / 1 client:  {best_many / best_one:.2f}x (bar >= 8x)")
    print(f"engine / generate():      {best_many / best_static:.2f}x (bar >= 1.0x)")


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" for v in values)


if __name__ == "__main__":
    main()
