"""A real Prometheus scrapes a live gateway and its engines under a short load: every dashboard query
parses and returns data, every alert rule evaluates without error, and `promtool check metrics`
passes on the gateway's and an engine's scrape.

The stack: two `tidegate engine` processes (tiny-random-llama) behind one pool with overload control
and three tiers, a second pool of two mock upstreams of which one answers half its requests with a
500 (upstream errors, retries), tenants on each tier plus one capped at a request a minute (rate
limiting) and a sheddable tier that may queue nothing (preset replies under a burst); the engines'
pool autoscales (desired replicas exported); the mock pool has a response cache with a Redis tier and
a semantic layer over an embedded MiniLM pool, and some of the load repeats deterministic questions."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import yaml
from support import ManagedProcess, free_port, start_process, start_redis, tidegate_argv

from tidegate.telemetry import dashboard

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yaml"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                                 reason="prometheus/promtool missing: Debian package `prometheus` (.ci/run installs it)")]

MODEL = "tiny-random-llama"
LOAD_S = 12.0


@dataclass
class Stack:
    gateway: str  # the API's base URL
    metrics: str  # the gateway's /metrics
    engine_metrics: str
    prometheus: str


def _query(prometheus: str, expr: str) -> dict:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:  # a query that does not parse: 400 with the reason
        return json.loads(error.read())


def _drive_load(base_url: str) -> None:
    """Bounded in time and count: streams on each tier, a sheddable burst, the flaky pool, a capped
    tenant, and two requests refused before any pool."""
    deadline = time.monotonic() + LOAD_S

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)

    def loop(key: str, model: str, stream: bool, max_tokens: int) -> None:
        api = client(key)
        for _ in range(200):
            if time.monotonic() > deadline:
                return
            try:
                reply = api.chat.completions.create(model=model, max_tokens=max_tokens, stream=stream,
                                                    messages=[{"role": "user", "content": "tell me a story"}],
                                                    extra_body={"ignore_eos": True})
                if stream:
                    for _chunk in reply:
                        pass
            except openai.APIError:
                pass  # refusals and upstream failures are what some of this load is for

    def repeat(key: str) -> None:  # the same deterministic questions, and paraphrases of them
        api = client(key)
        questions = ["How do I reset my password?", "How can I reset my password?", "What is a tide gate?"]
        for index in range(60):
            if time.monotonic() > deadline:
                return
            try:
                api.chat.completions.create(model="flaky", max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": questions[index % 3]}])
            except openai.APIError:
                pass

    threads = [threading.Thread(target=repeat, args=("sk-std",))]
    threads += [threading.Thread(target=loop, args=args) for args in
               [("sk-gold", MODEL, True, 8), ("sk-std", MODEL, True, 8), ("sk-std", MODEL, False, 8),
                *[("sk-free", MODEL, True, 16)] * 10, ("sk-std", "flaky", False, 4), ("sk-std", "flaky", False, 4),
                ("sk-capped", MODEL, False, 4)]]
    for thread in threads:
        thread.start()
    for key, model in (("sk-wrong", MODEL), ("sk-std", "no-such-model")):
        with pytest.raises(openai.APIStatusError):
            client(key).chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    for thread in threads:
        thread.join(timeout=LOAD_S + 40)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("prometheus")
    processes: list[ManagedProcess] = []
    try:
        engines = [free_port(), free_port()]
        for port in engines:
            processes.append(start_process(tidegate_argv("engine", "--model", MODEL, "--port", str(port),
                                                         "--threads", "1"),
                                           ready_url=f"http://127.0.0.1:{port}/health", timeout_s=240))
        mocks = [free_port(), free_port()]
        for port, error_rate in zip(mocks, ("0.5", "0")):
            processes.append(start_process(tidegate_argv("mock-upstream", "--port", str(port), "--model", "flaky",
                                                         "--tokens", "4", "--ttft-ms", "5", "--itl-ms", "1",
                                                         "--error-rate", error_rate),
                                           ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30))
        redis_process, redis_url = start_redis()
        processes.append(redis_process)
        port, metrics_port, prometheus_port = free_port(), free_port(), free_port()
        config = {
            "server": {"port": port, "metrics_port": metrics_port, "access_log": False},
            "pools": [{"name": MODEL, "backends": [{"type": "upstream", "url": f"http://127.0.0.1:{p}/v1",
                                                    "slot_limit": 4, "forward_priority": True} for p in engines],
                       "autoscale": {"min_replicas": 1, "max_replicas": 4, "tick_s": 1, "stable_window_s": 5,
                                     "panic_window_s": 2}},
                      {"name": "flaky", "backends": [{"type": "upstream", "url": f"http://127.0.0.1:{p}/v1"}
                                                     for p in mocks],
                       "response_cache": {"semantic": {"embedding_pool": "minilm"}}},
                      {"name": "minilm", "backends": [{"type": "embedded", "model": "all-MiniLM-L6-v2", "threads": 1}]}],
            "cache": {"redis_url": redis_url},
            "tenants": {"gold": {"api_keys": ["sk-gold"], "tier": "critical"},
                        "std": {"api_keys": ["sk-std"], "tier": "standard"},
                        "free": {"api_keys": ["sk-free"], "tier": "sheddable"},
                        "capped": {"api_keys": ["sk-capped"], "tier": "standard", "requests_per_minute": 1}},
            "tiers": {"default": "standard", "levels": {
                "critical": {"rank": 0, "max_queue_wait_s": 5, "ttft_target_s": 3},
                "standard": {"rank": 1, "max_queue_wait_s": 5, "ttft_target_s": 5},
                "sheddable": {"rank": 2, "queue_bound": 0, "max_queue_wait_s": 5, "ttft_target_s": 10}}},
            "degradation": {"preset_reply": "busy, try again later"},
        }
        (work / "gateway.yaml").write_text(yaml.safe_dump(config))
        processes.append(start_process(tidegate_argv("serve", "--config", str(work / "gateway.yaml")),
                                       ready_url=f"http://127.0.0.1:{port}/ready", timeout_s=60))
        scrape = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [
                      {"job_name": "tidegate-gateway", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]},
                      {"job_name": "tidegate-engine",
                       "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in engines]}]}]}
        (work / "prometheus.yml").write_text(yaml.safe_dump(scrape))
        assert PROMETHEUS is not None
        processes.append(start_process([PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
                                        f"--storage.tsdb.path={work / 'data'}",
                                        f"--web.listen-address=127.0.0.1:{prometheus_port}"],
                                       ready_url=f"http://127.0.0.1:{prometheus_port}/-/ready", timeout_s=60))
        stack = Stack(f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{metrics_port}/metrics",
                      f"http://127.0.0.1:{engines[0]}/metrics", f"http://127.0.0.1:{prometheus_port}")
        _drive_load(stack.gateway)
        time.sleep(3.0)  # the last scrapes
        yield stack
    finally:
        for process in reversed(processes):
            process.stop(timeout_s=30)


def _live(expr: str) -> str:
    return expr.replace("$__rate_interval", "30s").replace("$pool", ".*")


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    empty, failed = [], []
    for expr in dashboard.queries():
        answer = _query(stack.prometheus, _live(expr))
        if answer.get("status") != "success":
            failed.append((expr, answer.get("error")))
        elif not answer["data"]["result"]:
            empty.append(expr)
    assert not failed, failed
    assert not empty, empty


def test_the_latency_panels_show_numbers_not_nan(stack: Stack) -> None:
    """Over the load (a minute's window), the P99 by tier and the share within target are figures."""
    p99 = _query(stack.prometheus, "histogram_quantile(0.99, sum by (tier, le) "
                 "(rate(tidegate_overload_time_to_first_token_seconds_bucket[1m])))")["data"]["result"]
    tiers = {sample["metric"]["tier"]: float(sample["value"][1]) for sample in p99}
    assert {"critical", "standard"} <= set(tiers) and all(math.isfinite(v) and v > 0 for v in tiers.values()), tiers
    busy = _query(stack.prometheus, "max_over_time(rate(tidegate_engine_busy_seconds_total[5s])[1m:1s])")
    assert any(0 < float(s["value"][1]) <= 1.05 for s in busy["data"]["result"]), busy


def test_every_alert_rule_evaluates(stack: Stack) -> None:
    with urllib.request.urlopen(f"{stack.prometheus}/api/v1/rules", timeout=10) as response:
        groups = json.loads(response.read())["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) >= 18
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules
                                                             if r["health"] != "ok"]


@pytest.mark.parametrize("which", ["gateway", "engine"])
def test_promtool_check_metrics_passes_on_a_live_scrape(stack: Stack, which: str) -> None:
    url = stack.metrics if which == "gateway" else stack.engine_metrics
    with urllib.request.urlopen(url, timeout=10) as response:
        scrape = response.read()
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=scrape, capture_output=True, timeout=60)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
