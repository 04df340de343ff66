"""Experiments run for real: load from the load generator, faults on the timeline, and the report's figures
checked against what the load generator and the proxy recorded."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
import yaml

from tests.support import free_port, start_process, tidegate_argv
from tidegate.chaos.experiment import parse_experiment
from tidegate.chaos.report import build_report, classify, print_report
from tidegate.chaos.runner import run_experiment
from tidegate.cli import main


def _experiment(**document) -> object:
    return parse_experiment(yaml.safe_dump(document))


async def test_faults_land_on_the_loads_clock_and_the_report_counts_them(start_mock, tmp_path) -> None:
    mock = start_mock(tokens=4)
    listen = f"127.0.0.1:{free_port()}"
    experiment = _experiment(
        name="errors-for-one-second", duration_s=3.0, tail_s=0,
        load={"url": f"http://{listen}", "model": "mock-model", "rate": 10, "arrival": "constant",
              "stream": False, "timeout_s": 5},
        proxies={"edge": {"listen": listen, "target": f"127.0.0.1:{mock.port}"}},
        # halfway between two sends of the constant 10/s schedule: the switch (an HTTP call to the
        # proxy, another process) has 50 ms either way before it could meet a request
        steps=[{"at_s": 1.05, "proxy": {"name": "edge", "faults": {"error": {"status": 500}}}},
               {"at_s": 2.05, "proxy": {"name": "edge", "faults": "pass"}}])
    result = await run_experiment(experiment, log_dir=str(tmp_path))
    report = build_report(result)
    on, off = (event.t_s for event in result.timeline)
    points = [(record.sent_s + result.record_offset_s, record) for record in result.records]
    margin_s = 0.04
    inside = [record for t, record in points if on + margin_s <= t <= off - margin_s]
    outside = [record for t, record in points if t < on - margin_s or t > off + margin_s]
    assert inside and all(record.status == 500 for record in inside)
    assert outside and all(record.ok for record in outside)
    failed = sum(1 for _t, record in points if not record.ok)
    assert report["summary"]["http_errors"] == failed == result.proxies["edge"]["errors_injected"]
    assert report["summary"]["success_pct"] == pytest.approx(100 * (len(points) - failed) / len(points))
    assert report["timeline"][0]["failed_until_next"] == failed  # all of them in the fault's window
    assert report["timeline"][1]["failed_until_next"] == 0
    assert report["phases"]["during"]["http_errors"] == failed
    assert report["gateway"] is None  # no gateway given: nothing about ejection is claimed


@pytest.mark.slow
async def test_gateway_ejects_the_replica_behind_a_proxy_injecting_500s(start_mock, processes, tmp_path) -> None:
    # answers that take a while, so several are in flight and least-outstanding routing spreads them
    mocks = [start_mock("--ttft-ms", "20", "--itl-ms", "5", tokens=8) for _ in range(3)]
    proxy_port, admin_port, gateway_port = free_port(), free_port(), free_port()
    processes.append(start_process(
        tidegate_argv("chaos", "proxy", "--listen", f"127.0.0.1:{proxy_port}", "--target",
                      f"127.0.0.1:{mocks[0].port}", "--admin", f"127.0.0.1:{admin_port}"),
        ready_url=f"http://127.0.0.1:{admin_port}/faults", timeout_s=30))
    urls = [f"http://127.0.0.1:{proxy_port}/v1"] + [f"http://127.0.0.1:{m.port}/v1" for m in mocks[1:]]
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"port": gateway_port}, "health": {"interval_s": 0.5, "cooldown_s": 30},
        "pools": [{"name": "m", "backends": [{"type": "upstream", "url": url} for url in urls]}]}))
    processes.append(start_process(tidegate_argv("serve", "--config", str(config)),
                                   ready_url=f"http://127.0.0.1:{gateway_port}/ready", timeout_s=30))
    base = f"http://127.0.0.1:{gateway_port}"
    experiment = _experiment(
        name="flaky-replica", duration_s=6.0, tail_s=0.5,
        load={"url": base, "model": "m", "concurrency": 6, "stream": True, "timeout_s": 10},
        gateway={"metrics_url": f"{base}/metrics", "interval_s": 0.1},
        proxies={"flaky": {"admin": f"http://127.0.0.1:{admin_port}"}},
        steps=[{"at_s": 1.0, "proxy": {"name": "flaky", "faults": {"error": {"status": 500, "probability": 0.5},
                                                                  "paths": ["/v1/"]}}}])
    result = await run_experiment(experiment, log_dir=str(tmp_path))
    report = build_report(result)
    print_report(report)

    summary = report["summary"]
    ok = sum(1 for record in result.records if classify(record) == "ok")
    assert summary["requests"] == len(result.records) and summary["ok"] == ok
    # the gateway retries a 5xx that reached no client on another replica: what the load saw
    assert summary["success_pct"] >= 95.0
    (reaction,) = [row for row in report["gateway"]["reactions"] if row["measure"] == "eject"]
    assert reaction["note"] == "ejected" and reaction["replica"].endswith(f"@127.0.0.1:{proxy_port}")
    assert 0 < reaction["after_s"] < experiment.duration_s - 1.0
    # the proxy's count of injected errors is the gateway's count of 5xx from that replica
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    gateway_5xx = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("tidegate_upstream_errors_total") and f"127.0.0.1:{proxy_port}" in line
                      and 'kind="status_5xx"' in line)
    assert result.proxies["flaky"]["errors_injected"] == gateway_5xx > 0
    # a proxy the run only drove is left forwarding
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/faults", timeout=5) as response:
        assert b'"summary":"pass"' in response.read()



def test_cli_run_writes_the_report_and_fails_under_the_bar(start_mock, tmp_path, capsys) -> None:
    healthy, flaky = start_mock(tokens=2), start_mock("--error-rate", "0.5", "--seed", "3", tokens=2)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def experiment(port: int) -> str:
            path = tmp_path / f"experiment-{port}.yaml"
            path.write_text(yaml.safe_dump({
                "name": "cli", "duration_s": 1.0, "tail_s": 0,
                "load": {"url": f"http://127.0.0.1:{port}", "model": "mock-model", "rate": 20, "timeout_s": 5},
                "targets": {"sleepers": [{"pid": sleeper.pid}]},
                "steps": [{"at_s": 0.5, "kill": {"target": "sleepers"}}]}))
            return str(path)

        assert main(["chaos", "run", experiment(healthy.port), "--out", str(tmp_path / "ok"), "--quiet",
                     "--fail-under", "100"]) == 0
        assert sleeper.wait(timeout=10) == -9
        report = json.loads((tmp_path / "ok" / "chaos-report.json").read_text())
        assert report["summary"]["success_pct"] == 100.0 and report["summary"]["requests"] > 0
        assert [(row["action"], row["outcome"]) for row in report["timeline"]] == [("kill", "applied")]
        # the sleeper is gone: the second run's kill is skipped, with the reason, and the run goes on
        assert main(["chaos", "run", experiment(flaky.port), "--out", str(tmp_path / "flaky"), "--quiet",
                     "--fail-under", "99"]) == 1
        assert "is under 99 %" in capsys.readouterr().err
        report = json.loads((tmp_path / "flaky" / "chaos-report.json").read_text())
        assert (report["timeline"][0]["outcome"], report["timeline"][0]["detail"]) == ("skipped", "none running")
        assert report["summary"]["http_errors"] > 0
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(timeout=10)
