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


# the KV capacity as each engine exports it (vLLM's info gauge as vLLM 0.8-0.10 print it, two
# data-parallel engines; SGLang's as its production-metrics page shows, with tensor-parallel ranks)
VLLM_CACHE_CONFIG = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",\
enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.82",is_attention_free="False",num_cpu_blocks="1024",\
num_gpu_blocks="573",num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",\
enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.82",is_attention_free="False",num_cpu_blocks="1024",\
num_gpu_blocks="600",num_gpu_blocks_override="None",sliding_window="None",swap_space_bytes="4294967296"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen3-32b"} 2.0
"""
SGLANG_CAPACITY = """# HELP sglang:max_total_num_tokens Maximum total number of tokens
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="google/gemma-2-9b-it",pp_rank="0",tp_rank="0"} 161721.0
sglang:max_total_num_tokens{model_name="google/gemma-2-9b-it",pp_rank="0",tp_rank="1"} 161721.0
# HELP sglang:max_prefill_tokens Maximum prefill tokens
# TYPE sglang:max_prefill_tokens gauge
sglang:max_prefill_tokens{model_name="google/gemma-2-9b-it",pp_rank="0",tp_rank="0"} 16384.0
"""


def test_kv_capacity_is_read_from_our_engine_vllm_and_sglang() -> None:
    ours = ENGINE_METRICS + "# TYPE tidegate_engine_kv_cache_capacity_tokens gauge\n" \
        "tidegate_engine_kv_cache_capacity_tokens 5120.0\n"
    assert parse_engine_load(ours).kv_cache_tokens == 5120
    # blocks x block size, added up over data-parallel engines (each has a cache of its own)
    assert parse_engine_load(VLLM_CACHE_CONFIG) == ReplicaLoad(running_sequences=2, kv_cache_tokens=(573 + 600) * 16)
    # a tensor-parallel rank holds a slice of the same tokens: counted once
    assert parse_engine_load(SGLANG_CAPACITY).kv_cache_tokens == 161721


def test_a_kv_capacity_not_known_yet_reads_as_none_reported() -> None:
    profiling = VLLM_CACHE_CONFIG.replace('num_gpu_blocks="573"', 'num_gpu_blocks="None"')
    assert parse_engine_load(profiling).kv_cache_tokens == 600 * 16  # only the engine that knows it counts
    assert parse_engine_load(ENGINE_METRICS).kv_cache_tokens == 0
    assert parse_engine_load("vllm:cache_config_info{enable_prefix_caching=\"true\"} 1\n").kv_cache_tokens == 0


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


async def _checked(target: _Target, answers: list[int], status: list[int]) -> list[ReplicaHealth]:
    """One check per answer the server gives in turn; the target's health after each."""
    changes: list[int] = []
    checker = HealthChecker([target], interval_s=10, timeout_s=2, on_change=lambda: changes.append(1))
    seen = []
    await checker.start()
    try:
        for answer in answers:
            status[0] = answer
            await checker.check_once(target)
            seen.append(target.health)
    finally:
        await checker.stop()
    assert not changes  # nothing routable changed
    return seen


async def test_a_standby_that_stops_answering_is_loading_again_not_promotable() -> None:
    """A scale-out promotes a STANDBY into traffic at once, without a check of its own: a standby is
    therefore checked while it waits, and one that fails goes back to WARMING until it answers."""
    status = [200]
    runner, base = await _serve(status)
    target = _Target(base)
    target.health = ReplicaHealth.STANDBY
    try:
        seen = await _checked(target, [200, 503, 200], status)
    finally:
        await runner.cleanup()
    # answering: ready and out of traffic; not answering: loading again; answering again: ready again
    assert seen == [ReplicaHealth.STANDBY, ReplicaHealth.WARMING, ReplicaHealth.STANDBY]


async def test_a_draining_replica_is_left_to_its_actuator() -> None:
    status = [200]
    runner, base = await _serve(status)
    target = _Target(base)
    target.health = ReplicaHealth.DRAINING
    try:
        assert await _checked(target, [200, 503], status) == [ReplicaHealth.DRAINING] * 2
    finally:
        await runner.cleanup()
