"""Active health checks against a tiny in-process HTTP server; engine load parsing."""

from __future__ import annotations

from aiohttp import web

from tidegate.control.health_checks import HealthChecker, parse_engine_load
from tidegate.types import ReplicaHealth, ReplicaLoad

ENGINE_METRICS = """# HELP tidegate_engine_running_sequences running
# TYPE tidegate_engine_running_sequences gauge
tidegate_engine_running_sequences 3.0
tidegate_engine_waiting_sequences 7.0
tidegate_engine_kv_cache_usage 0.25
"""


class _Target:
    def __init__(self, base: str) -> None:
        self.replica_id = "r0"
        self.health = ReplicaHealth.UNKNOWN
        self.load = ReplicaLoad()
        self.health_url = f"{base}/health"
        self.scrape_url = f"{base}/metrics"


def test_engine_gauges_become_replica_load() -> None:
    assert parse_engine_load(ENGINE_METRICS) == ReplicaLoad(running_sequences=3, waiting_sequences=7,
                                                            kv_cache_usage=0.25)


VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama 3"} 5.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama 3"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama 3"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama 3"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama 3"} 0.6
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama 3"} 0.9
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="meta-llama/Llama 3"} 0.0
vllm:time_to_first_token_seconds_count{model_name="meta-llama/Llama 3"} 0.0
"""
SGLANG_METRICS = """sglang:num_running_reqs{model_name="qwen"} 12.0
sglang:num_queue_reqs{model_name="qwen"} 3.0
sglang:token_usage{model_name="qwen"} 0.28
sglang:num_running_reqs_total{model_name="qwen"} 99.0
"""


def test_vllm_gauges_add_up_over_data_parallel_engines_and_kv_use_is_the_fullest() -> None:
    assert parse_engine_load(VLLM_METRICS) == ReplicaLoad(running_sequences=7, waiting_sequences=4,
                                                          kv_cache_usage=0.9)


def test_vllm_v0_kv_gauge_and_sglang_gauges_are_read() -> None:
    assert parse_engine_load("vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.4 1700000000000\n") == ReplicaLoad(
        kv_cache_usage=0.4)
    assert parse_engine_load(SGLANG_METRICS) == ReplicaLoad(running_sequences=12, waiting_sequences=3,
                                                            kv_cache_usage=0.28)


def test_missing_gauges_or_a_page_that_is_not_prometheus_read_as_zero() -> None:
    assert parse_engine_load("other_metric 1\n") == ReplicaLoad()
    assert parse_engine_load("<html><body>vllm:num_requests_running is not here</body></html>") == ReplicaLoad()
    assert parse_engine_load("vllm:num_requests_running{broken 3\n") == ReplicaLoad()


async def _serve(health_status: list[int]) -> tuple[web.AppRunner, str]:
    async def health(_: web.Request) -> web.Response:
        return web.Response(status=health_status[0])

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=ENGINE_METRICS)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def test_check_marks_replica_healthy_and_reads_load() -> None:
    runner, base = await _serve([200])
    target, changes = _Target(base), []
    checker = HealthChecker([target], interval_s=10, timeout_s=2, on_change=lambda: changes.append(1))
    await checker.start()
    try:
        await checker.check_once(target)
    finally:
        await checker.stop()
        await runner.cleanup()
    assert target.health is ReplicaHealth.HEALTHY
    assert target.load.waiting_sequences == 7
    assert changes


async def test_failing_check_marks_healthy_replica_unhealthy() -> None:
    status = [200]
    runner, base = await _serve(status)
    target = _Target(base)
    checker = HealthChecker([target], interval_s=10, timeout_s=2, on_change=lambda: None)
    await checker.start()
    try:
        await checker.check_once(target)
        status[0] = 503
        await checker.check_once(target)
    finally:
        await checker.stop()
        await runner.cleanup()
    assert target.health is ReplicaHealth.UNHEALTHY


async def test_starting_replica_stays_unknown_until_first_success() -> None:
    runner, base = await _serve([503])
    target = _Target(base)
    checker = HealthChecker([target], interval_s=10, timeout_s=2, on_change=lambda: None)
    await checker.start()
    try:
        await checker.check_once(target)
    finally:
        await checker.stop()
        await runner.cleanup()
    assert target.health is ReplicaHealth.UNKNOWN
