"""Config validation: bad keys named, env substitution, secrets kept secret, embedded sizing."""

from __future__ import annotations

import pytest

from tidegate.config import ConfigError, EmbeddedBackend, UpstreamBackend, default_config, embedded_sizing, parse_config
from tidegate.gateway.app import _upstream_replica

MINIMAL = """
pools:
  - name: chat
    backends:
      - type: upstream
        url: http://127.0.0.1:9000/v1
"""


def test_minimal_config_parses_with_defaults() -> None:
    config = parse_config(MINIMAL, environ={})
    assert config.server.port == 8000
    backend = config.pools[0].backends[0]
    assert isinstance(backend, UpstreamBackend)
    assert backend.url == "http://127.0.0.1:9000/v1"


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"server\.prot: unknown key"):
        parse_config("server:\n  prot: 80\n" + MINIMAL, environ={})


def test_unknown_backend_key_is_named_with_its_path() -> None:
    text = MINIMAL + "        modle: x\n"
    with pytest.raises(ConfigError, match=r"pools\.0\.backends\.0\.upstream\.modle: unknown key"):
        parse_config(text, environ={})


def test_env_reference_is_substituted() -> None:
    config = parse_config(MINIMAL + "        api_key: ${UPSTREAM_KEY}\n", environ={"UPSTREAM_KEY": "sk-123"})
    assert config.pools[0].backends[0].api_key.get_secret_value() == "sk-123"


def test_env_default_is_used_when_unset() -> None:
    config = parse_config("server:\n  port: ${PORT:-8123}\n" + MINIMAL, environ={})
    assert config.server.port == 8123


def test_missing_env_is_named() -> None:
    with pytest.raises(ConfigError, match="UPSTREAM_KEY is not set"):
        parse_config(MINIMAL + "        api_key: ${UPSTREAM_KEY}\n", environ={})


def test_env_reference_in_a_comment_is_left_alone() -> None:
    config = parse_config("# export ${NOT_SET} first\n" + MINIMAL, environ={})
    assert config.pools[0].name


def test_secret_with_yaml_syntax_stays_one_string() -> None:
    secret = "sk-a: b # c"
    config = parse_config(MINIMAL + "        api_key: ${UPSTREAM_KEY}\n", environ={"UPSTREAM_KEY": secret})
    assert config.pools[0].backends[0].api_key.get_secret_value() == secret


def test_api_key_is_hidden_in_repr() -> None:
    config = parse_config(MINIMAL + "        api_key: sk-very-secret\n", environ={})
    assert "sk-very-secret" not in repr(config)
    assert "sk-very-secret" not in str(config.model_dump())


def test_bad_url_is_rejected() -> None:
    with pytest.raises(ConfigError, match="http"):
        parse_config(MINIMAL.replace("http://127.0.0.1:9000/v1", "ftp://x"), environ={})


def test_duplicate_pool_names_are_rejected() -> None:
    text = "pools:\n" + "\n".join(MINIMAL.split("pools:\n")[1] for _ in range(2))
    with pytest.raises(ConfigError, match="repeated: chat"):
        parse_config(text, environ={})


def test_pools_are_required() -> None:
    with pytest.raises(ConfigError, match="pools"):
        parse_config("server:\n  port: 1\n", environ={})


def test_overload_sections_are_typed() -> None:
    config = parse_config(MINIMAL + "tenants:\n  acme: {tier: critical, requests_per_minute: 5}\n", environ={})
    assert config.tenants["acme"].requests_per_minute == 5 and config.overload_control


def test_tenant_in_unknown_tier_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown tier 'gold'"):
        parse_config(MINIMAL + "tenants:\n  acme: {tier: gold}\n", environ={})


def test_degradation_naming_an_unknown_pool_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown pool 'small'"):
        parse_config(MINIMAL + "degradation:\n  pools:\n    chat: {fallback_pool: small}\n", environ={})


def test_not_yaml_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config("pools: [", environ={})


@pytest.mark.parametrize("cores, expected", [(1, (1, 1)), (2, (2, 1)), (4, (1, 2)), (8, (3, 2)), (16, (3, 4)),
                                             (64, (8, 4))])
def test_embedded_sizing(cores: int, expected: tuple[int, int]) -> None:
    assert embedded_sizing(cores) == expected


def test_default_config_serves_chat_and_embeddings_models() -> None:
    config = default_config(cpu_count=2)
    assert [pool.name for pool in config.pools] == ["tiny-random-llama", "all-MiniLM-L6-v2"]
    generation = config.pools[0].backends[0]
    assert isinstance(generation, EmbeddedBackend) and (generation.count, generation.threads) == (2, 1)


def test_serve_with_bad_config_exits_naming_the_key(tmp_path) -> None:
    import subprocess
    import sys

    path = tmp_path / "bad.yaml"
    path.write_text("server:\n  prot: 80\n" + MINIMAL)
    result = subprocess.run([sys.executable, "-m", "tidegate", "serve", "--config", str(path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "server.prot: unknown key" in result.stderr


@pytest.mark.parametrize("name", ["embedded.yaml", "upstreams.yaml", "mock.yaml", "scale-out.yaml"])
def test_examples_are_valid(name: str) -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / name
    parse_config(path.read_text(), source=name, environ={
        "TIDEGATE_API_KEY": "k", "OPENAI_API_KEY": "k", "REDIS_URL": "redis://127.0.0.1:6379/0",
        "ACME_KEY_SHA256": "a" * 64, "TRIAL_KEY_SHA256": "b" * 64})


@pytest.mark.parametrize(("metrics_path", "scrape_url"), [(None, None), ("/metrics", "http://10.0.0.5:8000/metrics"),
                                                          ("/stats", "http://10.0.0.5:8000/stats")])
def test_an_upstreams_load_gauges_are_read_from_its_metrics_path(metrics_path: str | None,
                                                                   scrape_url: str | None) -> None:
    backend = UpstreamBackend(url="http://10.0.0.5:8000/v1") if metrics_path == "/metrics" else UpstreamBackend(
        url="http://10.0.0.5:8000/v1", metrics_path=metrics_path)  # /metrics is the default
    replica = _upstream_replica("m", 0, backend, connect_timeout_s=1.0)
    assert replica.scrape_url == scrape_url
    assert replica.health_url == "http://10.0.0.5:8000/health"


def test_autoscale_parses_and_an_embedded_pool_cannot_want_more_workers_than_it_has() -> None:
    pool = ("pools:\n  - name: m\n    autoscale: {min_replicas: 1, max_replicas: %d}\n"
            "    backends:\n      - {type: embedded, model: tiny-random-llama, count: 2}\n")
    config = parse_config(pool % 2, environ={})
    assert config.pools[0].autoscale is not None and config.pools[0].autoscale.max_replicas == 2
    with pytest.raises(ConfigError, match="max_replicas \\+ standby \\(3\\) is more than its 2 embedded workers"):
        parse_config(pool % 3, environ={})
    with pytest.raises(ConfigError, match="min_replicas must be <= max_replicas"):
        parse_config("pools:\n  - name: m\n    autoscale: {min_replicas: 3, max_replicas: 2}\n"
                     "    backends:\n      - {type: upstream, url: 'http://127.0.0.1:9/v1'}\n", environ={})


def test_a_kubernetes_standby_needs_every_statefulset_pod_listed() -> None:
    def pool(kind: str, backends: int) -> str:
        return ("pools:\n  - name: m\n    autoscale: {max_replicas: 2, standby: 1, kubernetes: {kind: %s, name: vllm}}\n"
                "    backends:\n" % kind + "".join(f"      - {{type: upstream, url: 'http://vllm-{i}.vllm:8000/v1'}}\n"
                                                for i in range(backends)))
    assert parse_config(pool("StatefulSet", 3), environ={}).pools[0].autoscale.standby == 1
    for kind, backends in (("StatefulSet", 2), ("Deployment", 3)):
        with pytest.raises(ConfigError, match="needs a StatefulSet whose pods the pool lists"):
            parse_config(pool(kind, backends), environ={})


def test_autoscale_edge_reaches_the_policy_and_cannot_sit_under_the_target() -> None:
    from tidegate.gateway.scaling import autoscale_settings

    pool = ("pools:\n  - name: m\n    autoscale: {max_replicas: 4, target_utilisation: 0.85, %s}\n"
            "    backends:\n      - {type: upstream, url: 'http://127.0.0.1:9/v1'}\n")
    autoscale = parse_config(pool % "edge_utilisation: 1.0, edge_hold_s: 120", environ={}).pools[0].autoscale
    assert autoscale is not None
    replica = type("Replica", (), {"slot_limit": 8})()
    settings = autoscale_settings(autoscale, type("Pool", (), {"replicas": [replica]})())
    assert settings.edge_utilisation == 1.0 and settings.edge_hold_s == 120
    with pytest.raises(ConfigError, match="edge_utilisation must be >= target_utilisation"):
        parse_config(pool % "edge_utilisation: 0.8", environ={})


def test_autoscale_forecast_configures_the_predictive_layer() -> None:
    from tidegate.gateway.scaling import autoscale_settings, forecaster_for
    from tidegate.policy.forecast import HoltWinters, SeasonalNaive

    pool = ("pools:\n  - name: m\n    autoscale: {max_replicas: 4, forecast: %s}\n"
            "    backends:\n      - {type: upstream, url: 'http://127.0.0.1:9/v1'}\n")
    config = parse_config(pool % "{method: holt_winters, bucket_s: 30, season_s: 3600, cold_start_s: 90, alpha: 0.5}",
                          environ={})
    autoscale = config.pools[0].autoscale
    assert autoscale is not None and autoscale.forecast is not None
    forecaster = forecaster_for(autoscale)
    assert isinstance(forecaster, HoltWinters) and forecaster.alpha == 0.5 and forecaster.buckets == 120
    replica = type("Replica", (), {"slot_limit": 8})()
    settings = autoscale_settings(autoscale, type("Pool", (), {"replicas": [replica]})())
    assert settings.cold_start_s == 90 and settings.forecast_bucket_s == 30  # forecast a cold start ahead
    naive = parse_config(pool % "{method: seasonal_naive}", environ={}).pools[0].autoscale
    assert naive is not None and isinstance(forecaster_for(naive), SeasonalNaive)
    plain = parse_config(pool % "null", environ={}).pools[0].autoscale
    assert plain is not None and forecaster_for(plain) is None
    with pytest.raises(ConfigError, match="season_s must be >= bucket_s"):
        parse_config(pool % "{bucket_s: 60, season_s: 30}", environ={})
    with pytest.raises(ConfigError):
        parse_config(pool % "{method: prophet}", environ={})


def test_the_batch_api_is_off_without_a_redis_and_on_with_one() -> None:
    assert parse_config(MINIMAL).batch_redis_url is None
    shared = MINIMAL + "shared_state:\n  backend: redis\n  redis_url: redis://127.0.0.1:6379/0\n"
    assert parse_config(shared).batch_redis_url == "redis://127.0.0.1:6379/0"
    assert parse_config(shared + "batch:\n  enabled: false\n").batch_redis_url is None
    own = MINIMAL + "batch:\n  redis_url: redis://jobs:6379/2\n"
    assert parse_config(own).batch_redis_url == "redis://jobs:6379/2"


def test_a_batch_api_without_a_redis_or_with_an_unknown_tier_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="batch: enabled needs"):
        parse_config(MINIMAL + "batch:\n  enabled: true\n")
    with pytest.raises(ConfigError, match="tier 'nightly'"):
        parse_config(MINIMAL + "batch:\n  redis_url: redis://r:6379/0\n  tier: nightly\n")
    with pytest.raises(ConfigError, match="redis_url"):
        parse_config(MINIMAL + "batch:\n  redis_url: http://r:6379/0\n")


def test_a_shared_redis_with_custom_tiers_and_no_batch_tier_leaves_the_batch_api_off() -> None:
    config = parse_config(MINIMAL + "shared_state:\n  backend: redis\n  redis_url: redis://r:6379/0\n"
                          "tiers:\n  default: only\n  levels:\n    only: {rank: 0, max_queue_wait_s: 5, ttft_target_s: 5}\n")
    assert config.batch_redis_url is None


def test_latency_ejection_is_off_unless_set() -> None:
    assert parse_config(MINIMAL, environ={}).health.latency_factor is None
    config = parse_config(MINIMAL + "health:\n  latency_factor: 3.0\n", environ={})
    assert config.health.latency_factor == 3.0
    with pytest.raises(ConfigError):
        parse_config(MINIMAL + "health:\n  latency_factor: 0.5\n", environ={})


TWO_REPLICAS = """
pools:
  - name: chat
    backends:
      - {type: upstream, url: "http://127.0.0.1:9000/v1"}
      - {type: upstream, url: "http://127.0.0.1:9001/v1"}
    length_classes:
"""


def test_length_classes_map_replica_positions_to_their_ids() -> None:
    config = parse_config(TWO_REPLICAS + "      - {max_prompt_tokens: 512, replicas: [0]}\n"
                                         "      - {replicas: [1]}\n", environ={})
    classes = config.pools[0].length_class_policy(["a", "b"])
    assert classes is not None and classes.replicas_for(512) == {"a"} and classes.replicas_for(513) == {"b"}


@pytest.mark.parametrize("classes, message", [
    ("      - {max_prompt_tokens: 512, replicas: [0]}\n      - {replicas: [2]}\n",
     r"length_classes\[1\] names replicas \[2\]; the pool has replicas 0 to 1"),
    ("      - {max_prompt_tokens: 512, replicas: [0]}\n", "the last none"),
    ("      - {max_prompt_tokens: 512, replicas: [0]}\n      - {max_prompt_tokens: 100, replicas: [1]}\n"
     "      - {replicas: [1]}\n", "strictly increasing"),
    ("      - {max_prompt_tokens: 512, replicas: []}\n      - {replicas: [1]}\n", "replicas"),
])
def test_bad_length_classes_are_named(classes: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(TWO_REPLICAS + classes, environ={})


def test_length_classes_need_overload_control() -> None:
    with pytest.raises(ConfigError, match="length_classes needs overload_control"):
        parse_config("overload_control: false\n" + TWO_REPLICAS + "      - {replicas: [0, 1]}\n", environ={})
