"""Who may read /metrics (its labels name replicas' host:port), and where it is served."""

from __future__ import annotations

import urllib.error
import urllib.request

import openai
import pytest
from support import free_port

from tidegate.config import ConfigError, parse_config

from gateway_harness import Gateway, Upstream, upstream_pool

CLIENT_KEY = "client-key-1"
METRICS_KEY = "metrics-key-1"


def _status(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
            assert b"tidegate_requests_in_flight" in response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.fixture(scope="module")
def upstream(start_mock) -> Upstream:
    return start_mock()


def test_with_client_keys_and_no_metrics_setting_metrics_needs_a_client_key(upstream, start_gateway) -> None:
    gateway = start_gateway([upstream_pool("mock", upstream)], server={"api_keys": [CLIENT_KEY]})
    assert _status(f"{gateway.base}/metrics") == 401
    assert _status(f"{gateway.base}/metrics", "wrong") == 401
    assert _status(f"{gateway.base}/metrics", CLIENT_KEY) == 200
    # models.retrieve takes the same keys as the model list
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.api, api_key="wrong", max_retries=0).models.retrieve("mock")
    assert openai.OpenAI(base_url=gateway.api, api_key=CLIENT_KEY, max_retries=0).models.retrieve("mock").id == "mock"


def test_metrics_api_key_alone_opens_metrics(upstream, start_gateway) -> None:
    gateway = start_gateway([upstream_pool("mock", upstream)],
                            server={"api_keys": [CLIENT_KEY], "metrics_api_key": METRICS_KEY})
    assert _status(f"{gateway.base}/metrics") == 401
    assert _status(f"{gateway.base}/metrics", CLIENT_KEY) == 401
    assert _status(f"{gateway.base}/metrics", METRICS_KEY) == 200


def test_metrics_port_serves_metrics_there_only(upstream, start_gateway) -> None:
    metrics_port = free_port()
    gateway: Gateway = start_gateway([upstream_pool("mock", upstream)],
                                     server={"api_keys": [CLIENT_KEY], "metrics_port": metrics_port})
    assert _status(f"{gateway.base}/metrics", CLIENT_KEY) == 404
    assert _status(f"http://127.0.0.1:{metrics_port}/metrics") == 200  # the internal port is the guard
    assert _status(f"http://127.0.0.1:{metrics_port}/v1/models") == 404
    with urllib.request.urlopen(f"{gateway.base}/health", timeout=5) as response:  # probes stay here
        assert response.status == 200


def test_metrics_port_with_a_metrics_key_needs_the_key(upstream, start_gateway) -> None:
    metrics_port = free_port()
    start_gateway([upstream_pool("mock", upstream)], server={"metrics_port": metrics_port,
                                                              "metrics_api_key": METRICS_KEY})
    assert _status(f"http://127.0.0.1:{metrics_port}/metrics") == 401
    assert _status(f"http://127.0.0.1:{metrics_port}/metrics", METRICS_KEY) == 200


def test_without_any_key_metrics_stays_open_on_the_main_port(upstream, start_gateway) -> None:
    gateway = start_gateway([upstream_pool("mock", upstream)])
    assert _status(f"{gateway.base}/metrics") == 200


POOLS = "pools:\n  - name: chat\n    backends:\n      - {type: upstream, url: 'http://127.0.0.1:9000/v1'}\n"


@pytest.mark.parametrize(("server", "problem"), [
    ("{metrics_host: 0.0.0.0}", "metrics_host needs metrics_port"),
    ("{port: 9100, metrics_port: 9100}", "metrics_port must differ from port"),
])
def test_a_metrics_listener_config_that_cannot_work_is_refused(server: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_config(f"server: {server}\n" + POOLS, environ={})


def test_the_metrics_key_is_a_secret() -> None:
    config = parse_config("server: {metrics_api_key: '${KEY}'}\n" + POOLS, environ={"KEY": "s3cret"})
    assert "s3cret" not in repr(config) and config.server.metrics_api_key.get_secret_value() == "s3cret"
