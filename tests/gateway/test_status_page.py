"""GET /status and /status.json: a live page of pools, replicas, queues, TTFT against targets and
refusals; the access of /metrics; no upstream key on it; read back in headless Chromium under load."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import ManagedProcess, free_port, start_process, tidegate_argv  # noqa: E402

from tidegate.gateway.overload_metrics import quantile_from_buckets  # noqa: E402

UPSTREAM_KEY = "sk-upstream-secret-1234"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_quantiles_interpolate_within_the_bucket_as_prometheus_does() -> None:
    buckets = [(1.0, 0.0), (5.0, 10.0), (math.inf, 10.0)]
    assert quantile_from_buckets(0.5, buckets) == pytest.approx(3.0)
    assert quantile_from_buckets(0.99, buckets) == pytest.approx(4.96)
    assert quantile_from_buckets(0.5, [(1.0, 4.0), (math.inf, 8.0)]) == 1.0  # in +Inf: its lower bound
    assert math.isnan(quantile_from_buckets(0.5, [(1.0, 0.0), (math.inf, 0.0)]))


class _Stack:
    def __init__(self, api: str, main: str, metrics: str) -> None:
        self.api, self.main, self.metrics = api, main, metrics


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Stack]:
    processes: list[ManagedProcess] = []
    try:
        mocks = [free_port(), free_port()]
        for port in mocks:
            processes.append(start_process(tidegate_argv("mock-upstream", "--port", str(port), "--tokens", "8",
                                                         "--ttft-ms", "20", "--itl-ms", "5"),
                                           ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30))
        port, metrics_port = free_port(), free_port()
        config = {"server": {"port": port, "metrics_port": metrics_port, "access_log": False},
                  "pools": [{"name": "m", "backends": [{"type": "upstream", "url": f"http://127.0.0.1:{p}/v1",
                                                        "api_key": UPSTREAM_KEY, "slot_limit": 4} for p in mocks]}],
                  "tenants": {"gold": {"api_keys": ["sk-gold"], "tier": "critical"},
                              "std": {"api_keys": ["sk-std"], "tier": "standard"}}}
        path = tmp_path_factory.mktemp("status") / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        processes.append(start_process(tidegate_argv("serve", "--config", str(path)),
                                       ready_url=f"http://127.0.0.1:{port}/ready", timeout_s=30))
        yield _Stack(f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}")
    finally:
        for process in reversed(processes):
            process.stop()


def _get(url: str, key: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _streams(api: str, key: str, count: int) -> None:
    client = openai.OpenAI(base_url=api, api_key=key, max_retries=0, timeout=30)
    for _ in range(count):
        for _chunk in client.chat.completions.create(model="m", max_tokens=8, stream=True,
                                                     messages=[{"role": "user", "content": "hi"}]):
            pass


def test_the_page_is_served_where_metrics_is_and_to_whom(stack: _Stack) -> None:
    assert _get(f"{stack.main}/status")[0] == 404  # /metrics has a port of its own: so has the page
    status, page = _get(f"{stack.metrics}/status")
    assert status == 200 and b"<title>tidegate status</title>" in page and b'http-equiv="refresh"' in page
    assert b"<script" not in page and b"http://" not in page and b"https://" not in page  # nothing fetched


def test_the_page_shows_ttft_by_tier_against_targets_and_never_an_upstream_key(stack: _Stack) -> None:
    _streams(stack.api, "sk-gold", 6)
    _streams(stack.api, "sk-std", 6)
    status, body = _get(f"{stack.metrics}/status.json")
    assert status == 200
    snapshot = json.loads(body)
    pool = snapshot["pools"][0]
    assert pool["pool"] == "m" and len(pool["replicas"]) == 2
    tiers = {tier["tier"]: tier for tier in pool["tiers"]}
    assert tiers["critical"]["first_tokens"] == 6 and tiers["standard"]["first_tokens"] == 6
    assert 0 < tiers["critical"]["ttft_p99_s"] < tiers["critical"]["target_s"]
    assert {row["status"]: row["count"] for row in snapshot["answered"]}["200"] >= 12
    for path in ("/status", "/status.json"):
        assert UPSTREAM_KEY.encode() not in _get(f"{stack.metrics}{path}")[1]


def test_the_status_page_can_be_switched_off(tmp_path: Path) -> None:
    mock_port, port = free_port(), free_port()
    mock = start_process(tidegate_argv("mock-upstream", "--port", str(mock_port)),
                         ready_url=f"http://127.0.0.1:{mock_port}/health", timeout_s=30)
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"server": {"port": port, "status_page": False},
                                    "pools": [{"name": "m", "backends": [
                                        {"type": "upstream", "url": f"http://127.0.0.1:{mock_port}/v1"}]}]}))
    gateway = start_process(tidegate_argv("serve", "--config", str(path)), ready_url=f"http://127.0.0.1:{port}/ready",
                            timeout_s=30)
    try:
        assert _get(f"http://127.0.0.1:{port}/status")[0] == 404
        assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 200
    finally:
        gateway.stop()
        mock.stop()


class _Figures(HTMLParser):
    """`data-metric` -> `data-value` of every figure on the page."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("data-metric"):
            self.values[found["data-metric"] or ""] = found.get("data-value") or ""


def _scrape(url: str) -> dict[str, float]:
    text = _get(f"{url}/metrics")[1].decode()
    return {f"{sample.name}{{{','.join(f'{k}={chr(34)}{v}{chr(34)}' for k, v in sample.labels.items())}}}": sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium missing: Debian package `chromium` (.ci/run installs it)")
def test_headless_chromium_reads_live_figures_that_agree_with_metrics(stack: _Stack, tmp_path: Path) -> None:
    stop = time.monotonic() + 8.0

    def load() -> None:
        client = openai.OpenAI(base_url=stack.api, api_key="sk-std", max_retries=0, timeout=30)
        for _ in range(400):  # bounded in count and time
            if time.monotonic() > stop:
                return
            for _chunk in client.chat.completions.create(model="m", max_tokens=8, stream=True,
                                                         messages=[{"role": "user", "content": "hi"}]):
                pass

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2.0)
        before = _scrape(stack.metrics)
        browser = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        dom = subprocess.run([*browser, "--dump-dom", f"{stack.metrics}/status"], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        after = _scrape(stack.metrics)
        screenshot = tmp_path / "status-page.png"
        subprocess.run([*browser, "--window-size=1280,900", f"--screenshot={screenshot}", f"{stack.metrics}/status"],
                       capture_output=True, timeout=120, check=True)
    finally:
        for thread in threads:
            thread.join(timeout=60)
    figures = _Figures()
    figures.feed(dom)
    answered = 'tidegate_requests_total{pool="m",status="200"}'
    assert before[answered] <= float(figures.values[answered]) <= after[answered], (before[answered], after[answered])
    assert float(figures.values[answered]) > 0
    healthy = [key for key in figures.values if key.startswith("tidegate_replica_healthy{")]
    assert len(healthy) == 2 and all(float(figures.values[key]) == after[key] == 1.0 for key in healthy), healthy
    assert float(figures.values['first_tokens{pool="m",tier="standard"}']) > 0
    assert screenshot.stat().st_size > 10_000
    print(f"status page screenshot: {screenshot}")
