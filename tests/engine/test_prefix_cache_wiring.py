"""Prefix caching's switch (`tidegate engine --no-prefix-caching`) and its /metrics counters."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tests.engine.fake_runner import FakeRunner
from tidegate.engine import cli
from tidegate.engine.kv_cache import BLOCK_SIZE, BlockManager
from tidegate.engine.loop import EngineLoop
from tidegate.engine.metrics import EngineMetrics
from tidegate.engine.scheduler import Scheduler, SchedulerConfig
from tidegate.engine.sequence import SamplingParams

SYSTEM = list(range(100, 100 + 4 * BLOCK_SIZE))


def _metric(metrics: EngineMetrics, name: str) -> float:
    for line in metrics.exposition().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing")


async def _serve_one_after_another(loop: EngineLoop, prompts: list[list[int]]) -> None:
    loop.start(asyncio.get_running_loop())
    try:
        for prompt in prompts:
            submission = loop.submit(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
            while (await asyncio.wait_for(submission.outputs.get(), 30.0)).finish_reason is None:
                pass
        await asyncio.sleep(0.05)  # the loop publishes its counters after the step that finished
    finally:
        loop.stop()


def test_metrics_count_prompt_tokens_looked_up_found_and_blocks_evicted() -> None:
    # 6 blocks: the second prompt finds the first's 4 system blocks; the third, unrelated and of
    # 5 blocks, evicts cached ones
    metrics = EngineMetrics()
    scheduler = Scheduler(SchedulerConfig(max_batch_tokens=256), BlockManager(6 * BLOCK_SIZE))
    prompts = [SYSTEM + [1, 2], SYSTEM + [3], list(range(500, 500 + 5 * BLOCK_SIZE))]
    asyncio.run(_serve_one_after_another(EngineLoop(scheduler, FakeRunner(), metrics), prompts))
    assert _metric(metrics, "tidegate_engine_prefix_cache_queries_tokens_total") == sum(len(p) for p in prompts)
    assert _metric(metrics, "tidegate_engine_prefix_cache_hits_tokens_total") == len(SYSTEM)
    assert _metric(metrics, "tidegate_engine_prefix_cache_evictions_total") == scheduler.blocks.evicted_blocks > 0


def _engine_options(argv: list[str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The EngineOptions `tidegate engine` would serve with these flags (the server is not started)."""
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    served = []
    monkeypatch.setattr(cli, "_serve", lambda options, *rest: served.append(options) or 0)
    monkeypatch.setattr(cli.sys, "setswitchinterval", lambda interval_s: None)  # the test process's own
    cli.run(parser.parse_args(["--model", "tiny-random-llama", "--port", "1", *argv]))
    return served[0]


def test_prefix_caching_is_on_unless_the_flag_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _engine_options([], monkeypatch).enable_prefix_caching is True
    assert _engine_options(["--no-prefix-caching"], monkeypatch).enable_prefix_caching is False


@pytest.mark.slow
def test_the_built_engine_schedules_with_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidegate.engine.builder import build_generation_engine

    options = _engine_options(["--no-prefix-caching", "--kv-cache-tokens", "1024"], monkeypatch)
    assert build_generation_engine(options).model_card["enable_prefix_caching"] is False


@pytest.mark.slow
def test_the_built_engine_exports_its_kv_capacity_as_the_gateway_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from tidegate.control.health_checks import parse_engine_load
    from tidegate.engine.builder import build_generation_engine

    metrics = EngineMetrics()
    assert parse_engine_load(metrics.exposition().decode()).kv_cache_tokens == 0  # not loaded yet: none known
    build_generation_engine(_engine_options(["--kv-cache-tokens", "1000"], monkeypatch), metrics)
    # whole blocks only: 62 of 16 tokens
    assert _metric(metrics, "tidegate_engine_kv_cache_capacity_tokens") == 62 * BLOCK_SIZE
    assert parse_engine_load(metrics.exposition().decode()).kv_cache_tokens == 62 * BLOCK_SIZE
