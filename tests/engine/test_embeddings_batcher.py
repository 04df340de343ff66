"""EmbeddingBatcher over a fake model: batches form across requests, results go back per request."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from tidegate.engine.embeddings import EmbeddingBatcher
from tidegate.errors import InternalError, OverloadedError


class FakeEmbeddingModel:
    """Stands in for EmbeddingModel: one token per word, a vector that identifies the text."""

    name = "fake-embedder"
    dimensions = 4
    max_tokens = 8

    def __init__(self, *, fail_on: str | None = None, block: threading.Event | None = None) -> None:
        self.batches: list[list[str]] = []
        self.threads: set[str] = set()
        self._fail_on = fail_on
        self._block = block

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [min(len(text.split()) + 2, self.max_tokens) for text in texts]

    def embed(self, texts: list[str]) -> np.ndarray:
        if self._block is not None:
            self._block.wait(timeout=5)
        self.threads.add(threading.current_thread().name)
        if self._fail_on in texts:
            raise RuntimeError("model exploded")
        self.batches.append(list(texts))
        return np.stack([self.vector(text) for text in texts]) if texts else np.zeros((0, 4), np.float32)

    @staticmethod
    def vector(text: str) -> np.ndarray:
        raw = np.array([len(text), sum(map(ord, text)) % 97, 1.0, 2.0], dtype=np.float32)
        return raw / np.linalg.norm(raw)


@pytest.fixture
async def batcher_factory():
    started: list[EmbeddingBatcher] = []

    async def make(model: FakeEmbeddingModel, **options) -> EmbeddingBatcher:
        batcher = EmbeddingBatcher(model, **{"max_batch_size": 4, "max_queue_delay_ms": 5.0, **options})
        await batcher.start()
        model.batches.clear()  # forget the warm-up call
        started.append(batcher)
        return batcher

    yield make
    for batcher in started:
        await batcher.close()


async def test_results_match_each_request(batcher_factory) -> None:
    batcher = await batcher_factory(FakeEmbeddingModel())
    requests = [[f"text {i}", f"other text {i} here"] for i in range(6)]
    results = await asyncio.gather(*(batcher.embed(texts) for texts in requests))
    for texts, (vectors, _tokens) in zip(requests, results):
        np.testing.assert_array_equal(vectors, np.stack([FakeEmbeddingModel.vector(t) for t in texts]))


async def test_prompt_tokens_sum_each_requests_texts(batcher_factory) -> None:
    batcher = await batcher_factory(FakeEmbeddingModel())
    _vectors, tokens = await batcher.embed(["one", "two words"])
    assert tokens == 3 + 4


async def test_concurrent_requests_share_a_batch(batcher_factory) -> None:
    model = FakeEmbeddingModel()
    batcher = await batcher_factory(model)
    await asyncio.gather(*(batcher.embed([f"t{i}"]) for i in range(4)))
    assert [len(batch) for batch in model.batches] == [4]


async def test_large_request_is_split_into_batches(batcher_factory) -> None:
    model = FakeEmbeddingModel()
    batcher = await batcher_factory(model)
    vectors, _tokens = await batcher.embed([f"t{i}" for i in range(10)])
    assert vectors.shape == (10, 4)
    assert max(len(batch) for batch in model.batches) == 4


async def test_batches_run_in_one_worker_thread(batcher_factory) -> None:
    model = FakeEmbeddingModel()
    batcher = await batcher_factory(model)
    await asyncio.gather(*(batcher.embed([f"t{i}"] * 3) for i in range(8)))
    assert len(model.threads) == 1 and threading.current_thread().name not in model.threads


async def test_stats_count_padding(batcher_factory) -> None:
    batcher = await batcher_factory(FakeEmbeddingModel(), max_batch_size=2)
    await batcher.embed(["a", "a b c d"])  # 3 and 6 tokens, one batch padded to 6
    stats = batcher.stats()
    assert (stats.tokens, stats.padded_tokens) == (9, 12)


async def test_model_failure_fails_only_its_request(batcher_factory) -> None:
    batcher = await batcher_factory(FakeEmbeddingModel(fail_on="boom"), max_batch_size=1)
    with pytest.raises(InternalError):
        await batcher.embed(["boom"])
    vectors, _tokens = await batcher.embed(["fine"])
    assert vectors.shape == (1, 4)


async def test_full_queue_is_refused(batcher_factory) -> None:
    gate = threading.Event()
    gate.set()  # let the warm-up call through
    batcher = await batcher_factory(FakeEmbeddingModel(block=gate), max_batch_size=1, max_queued_texts=3)
    gate.clear()
    running = asyncio.create_task(batcher.embed(["a"]))
    await asyncio.sleep(0.05)  # "a" is in the worker; the queue is empty again
    waiting = asyncio.create_task(batcher.embed(["b", "c", "d"]))
    await asyncio.sleep(0)
    with pytest.raises(OverloadedError):
        await batcher.embed(["e"])
    gate.set()
    await asyncio.gather(running, waiting)


async def test_cancelled_request_is_not_computed(batcher_factory) -> None:
    gate = threading.Event()
    gate.set()  # let the warm-up call through
    model = FakeEmbeddingModel(block=gate)
    batcher = await batcher_factory(model, max_batch_size=1)
    gate.clear()
    running = asyncio.create_task(batcher.embed(["first"]))
    await asyncio.sleep(0.05)
    abandoned = asyncio.create_task(batcher.embed(["abandoned"]))
    await asyncio.sleep(0)
    abandoned.cancel()
    await asyncio.sleep(0)
    gate.set()
    await running
    await batcher.embed(["after"])
    assert ["abandoned"] not in model.batches


async def test_empty_input_returns_no_vectors(batcher_factory) -> None:
    batcher = await batcher_factory(FakeEmbeddingModel())
    vectors, tokens = await batcher.embed([])
    assert vectors.shape == (0, 4) and tokens == 0


async def test_close_fails_waiting_requests(batcher_factory) -> None:
    gate = threading.Event()
    gate.set()  # let the warm-up call through
    batcher = await batcher_factory(FakeEmbeddingModel(block=gate), max_batch_size=1)
    gate.clear()
    running = asyncio.create_task(batcher.embed(["a"]))
    await asyncio.sleep(0.05)
    waiting = asyncio.create_task(batcher.embed(["b"]))
    await asyncio.sleep(0)
    await batcher.close()
    gate.set()
    with pytest.raises(OverloadedError):
        await waiting
    running.cancel()
