"""`tidegate sim`: profiles, a simulated run from the command line, and calibration against a real engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tidegate.cli import main
from tidegate.loadgen.report import REQUIRED_KEYS
from tidegate.loadgen.report_cli import load_report
from tidegate.sim.profile import load_profile
from tests.support import ManagedProcess, free_port, start_process, tidegate_argv


def test_profiles_are_listed_with_whether_they_are_estimates(capsys) -> None:
    assert main(["sim", "profiles"]) == 0
    out = capsys.readouterr().out
    assert "tiny-random-llama-cpu" in out and "measured" in out and "estimate" in out


def test_a_run_is_a_function_of_its_inputs_and_prints_both_arms(tmp_path, capsys) -> None:
    argv = ["sim", "run", "--profile", "tiny-random-llama-cpu", "--replicas", "2", "--rate", "6", "--duration-s", "20",
            "--prompt-tokens", "16,200", "--output-tokens", "8,64", "--mix", "critical:0.2,standard:0.8", "--fifo"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "overload control" in out and "FIFO" in out and "critical" in out and "busy" in out
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    first, second = ((tmp_path / d / "summary.json").read_bytes() for d in "ab")
    assert first == second  # byte-identical
    assert (tmp_path / "a" / "report.json").read_bytes() == (tmp_path / "b" / "report.json").read_bytes()
    assert (tmp_path / "a" / "records.jsonl").read_bytes() == (tmp_path / "b" / "records.jsonl").read_bytes()
    report = json.loads(first)
    run = report["runs"]["overload control"]
    assert sum(t["arrived"] for t in run["tiers"]) == report["requests"] > 80
    assert len(run["replicas"]) == 2


def test_a_simulated_run_writes_the_bench_report_schema_and_plots(tmp_path) -> None:
    argv = ["sim", "run", "--rate", "6", "--duration-s", "20", "--prompt-tokens", "16,200", "--output-tokens", "8,64",
            "--mix", "critical:0.3,sheddable:0.7", "--fifo", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = load_report(tmp_path / "report.json")
    assert set(REQUIRED_KEYS) <= set(report) and report["targets"] == ["overload control", "FIFO"]
    assert {t["name"]: t["ttft_target_ms"] for t in report["tiers"]}["critical"] == 3000.0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for target, arm in enumerate(("overload control", "FIFO")):
        tiers = {t["tier"]: t for t in summary["runs"][arm]["tiers"]}
        for group in (s for s in report["summaries"] if s["target"] == target and s["tier"] != "all"):
            tier = tiers[group["tier"]]  # the same requests, judged the same way, in both documents
            assert (group["requests"], group["succeeded"], group["good"]) == (tier["arrived"], tier["served"],
                                                                              tier["good"])
            assert group["statuses"].get("503", 0) == tier["refused"]
    series = {m["series"].split("{")[0] for m in report["metrics"]}
    assert {"tidegate_queue_depth", "tidegate_replica_outstanding", "tidegate_sim_replica_busy_ratio"} <= series
    assert all((tmp_path / name).stat().st_size > 0 for name in ("latency.png", "load.png", "replicas.png",
                                                                 "timeline.png"))


def test_the_shipped_trace_replays_compressed(capsys) -> None:
    assert main(["sim", "run", "--trace", "--speedup", "60", "--duration-s", "30", "--replicas", "2"]) == 0
    assert "standard" in capsys.readouterr().out


def test_bad_input_is_a_clear_error_not_a_traceback(capsys) -> None:
    assert main(["sim", "run", "--profile", "nope", "--rate", "1"]) == 2
    assert "no shipped profile" in capsys.readouterr().err
    assert main(["sim", "run", "--rate", "1", "--mix", "gold:1"]) == 2
    assert "unknown tier" in capsys.readouterr().err


@pytest.fixture(scope="module")
def step_log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("steps")


@pytest.fixture(scope="module")
def engine(step_log_dir: Path) -> Iterator[str]:
    port = free_port()
    argv = tidegate_argv("engine", "--model", "tiny-random-llama", "--port", str(port), "--threads", "1",
                         "--kv-cache-tokens", "8192", "--step-log", str(step_log_dir / "steps-{pid}.csv"))
    process: ManagedProcess = start_process(argv, ready_url=f"http://127.0.0.1:{port}/health", timeout_s=120)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.stop()


@pytest.mark.slow
def test_calibrating_a_real_engine_writes_a_profile_with_its_held_out_error(engine: str, tmp_path, capsys) -> None:
    out = tmp_path / "measured.json"
    code = main(["sim", "calibrate", "--url", engine + "/v1", "--model", "tiny-random-llama", "--out", str(out),
                 "--prompt-tokens", "8,48,96,150,200,300", "--batches", "1,4,8", "--contexts", "8,128",
                 "--repeats", "1", "--kv-cache-tokens", "8192"])
    assert code == 0
    profile = load_profile(out)
    # the limits the engine states on /v1/models
    assert profile.name == "measured" and not profile.estimate and profile.kv_cache_tokens == 8192
    assert profile.max_batch_tokens == 96 and profile.attention_cost_tokens and profile.attention_cost_tokens > 100
    assert profile.cost.base_s > 0 and profile.cost.prefill_s_per_token > 0
    assert profile.fit is not None and profile.fit.held_out_samples == 4
    assert "held-out shapes: 4" in capsys.readouterr().out


@pytest.mark.slow
def test_the_steps_an_engine_logged_while_serving_fit_a_profile_too(engine: str, step_log_dir: Path,
                                                                     tmp_path, capsys) -> None:
    import openai

    client = openai.OpenAI(base_url=engine + "/v1", api_key="unused")
    for tokens in (5, 40):  # some steps of each kind, whatever ran before
        client.completions.create(model="tiny-random-llama", prompt="x" * tokens * 4, max_tokens=tokens,
                                  extra_body={"ignore_eos": True})
    logs = sorted(step_log_dir.glob("steps-*.csv"))
    assert len(logs) == 1  # line-buffered: readable while the engine runs
    lines = logs[0].read_text().splitlines()
    # five columns, then what the decode attention read: the decodes' context, rows, positions, path, copies
    assert len(lines) >= 45 and all(len(line.split(",")) == 10 for line in lines)
    from tidegate.sim.costfit import read_step_log

    decoding = [step for step in read_step_log(lines) if step.decodes]
    assert decoding and all(step.decode_path == "mirror" and step.decode_rows >= step.decodes
                            and step.decode_positions <= step.decode_context_tokens for step in decoding)
    out = tmp_path / "in-situ.json"
    assert main(["sim", "calibrate", "--step-log", str(logs[0]), "--out", str(out)]) == 0
    profile = load_profile(out)
    assert profile.cost.base_s > 0 and "logged while serving" in profile.sources[0]
    # the decode attention fitted as the engine runs it, from the same log (an option: docs/simulator.md)
    assert main(["sim", "calibrate", "--step-log", str(logs[0]), "--decode-attention", "--out", str(out)]) == 0
    assert load_profile(out).cost.base_s > 0


def test_the_progress_bar_and_the_probes_change_nothing_in_the_run() -> None:
    from tidegate.sim_cli import _progress_bar
    from tidegate.simulate import Simulation, poisson_requests

    simulation = Simulation(replicas=2)
    requests = poisson_requests(8.0, 20.0, prompt_tokens=(64, 1024), output_tokens=(32, 256), seed=3)
    with _progress_bar(requests, "x", shown=True) as before_run:
        with_bar = simulation.run(requests, before_run=before_run)
    plain = simulation.run(requests, probe=False)
    assert with_bar.result.records == plain.result.records and with_bar.summary == plain.summary
    probes = with_bar.result.probes  # sampled for the report's replica and queue series
    assert len(probes) == 20 and not plain.result.probes
    assert min(p.queued for p in probes) >= 0 and max(sum(p.sequences) for p in probes) > 0


def test_an_autoscaled_run_prints_its_decisions_and_draws_its_fleet(tmp_path, capsys) -> None:
    argv = ["sim", "run", "--replicas", "4", "--autoscale", "--rate", "8", "--duration-s", "60", "--prompt-tokens",
            "16,200", "--output-tokens", "8,64", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "autoscaler:" in out and "replica-hours" in out
    report = load_report(tmp_path / "report.json")
    ready = [m["value"] for m in report["metrics"] if m["series"].startswith("tidegate_replicas_ready")]
    assert ready and max(ready) > 1  # it grew from the one replica it started with
    assert (tmp_path / "fleet.png").stat().st_size > 0
