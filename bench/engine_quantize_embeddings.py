"""MiniLM embeddings at fp32, bf16 and dynamic int8: speed-up over fp32 and cosine to fp32.

The default precision is chosen from these figures and must not be lossy (cosine >= 0.999).
int8 variants: per-tensor weight scales, per-channel (what `--quantize int8` uses), and
per-channel with the feed-forward output projections kept in fp32 (their inputs, after GELU,
carry the outliers that int8 activations clip).
Speed: texts/s embedding a fixed set of 256 texts (4-120 words) in length-sorted batches of 32,
and one text at a time; variants are timed in interleaved repeats and the best repeat is kept,
so that other load on the machine hurts every variant alike.

Run: python bench/engine_quantize_embeddings.py [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from engine_embeddings import MODEL, workload


def load_variants(threads: int) -> dict[str, object]:
    from tidegate.engine.embeddings import EmbeddingModel, quantize_int8

    fp32 = EmbeddingModel.load(MODEL, dtype="fp32", threads=threads)
    variants = {"fp32": fp32, "bf16": EmbeddingModel.load(MODEL, dtype="bf16")}
    for label, options in [
        ("int8 per-tensor", {"per_channel": False}),
        ("int8 per-channel (--quantize int8)", {"per_channel": True}),
        ("int8 per-channel, FFN out fp32", {"per_channel": True, "skip": ("output.dense",)}),
    ]:
        model = EmbeddingModel.load(MODEL, dtype="fp32")
        model._model = quantize_int8(model._model, **options)
        variants[label] = model
    return variants


def seconds_for(model, texts: list[str], batch_size: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        model.embed(texts[i : i + batch_size])
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    texts = sorted(workload(256, seed=11), key=len)  # sorted: batches of like length, as the batcher forms
    singles = workload(48, seed=12)
    variants = load_variants(args.threads)
    print(f"machine: {os.cpu_count()} CPUs; torch threads: {torch.get_num_threads()}; "
          f"quantized engine: {torch.backends.quantized.engine}")
    reference = variants["fp32"].embed(texts)
    best_batched = {label: float("inf") for label in variants}
    best_single = {label: float("inf") for label in variants}
    for label, model in variants.items():  # warm-up: oneDNN builds kernels per shape on first use
        seconds_for(model, texts, 32)
        seconds_for(model, singles, 1)
    for _ in range(args.repeats):
        for label, model in variants.items():
            best_batched[label] = min(best_batched[label], seconds_for(model, texts, 32))
            best_single[label] = min(best_single[label], seconds_for(model, singles, 1))

    print(f"{'variant':38s} {'batch32 t/s':>11s} {'speed-up':>8s} {'batch1 t/s':>10s} {'speed-up':>8s} "
          f"{'mean cos':>9s} {'min cos':>8s}")
    for label, model in variants.items():
        cosines = (model.embed(texts) * reference).sum(axis=1)
        batched = len(texts) / best_batched[label]
        single = len(singles) / best_single[label]
        print(f"{label:38s} {batched:11.1f} {best_batched['fp32'] / best_batched[label]:7.2f}x "
              f"{single:10.1f} {best_single['fp32'] / best_single[label]:7.2f}x "
              f"{float(np.mean(cosines)):9.5f} {float(np.min(cosines)):8.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
