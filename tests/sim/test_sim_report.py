"""A simulated run as a bench report: every outcome maps onto what a live client would record."""

from __future__ import annotations

from tidegate.policy.tiers import default_tiers
from tidegate.sim.harness import Harness, KillReplica
from tidegate.sim.scenarios import controller, mixed, replica_spec
from tidegate.sim_report import FAILED_STATUS, REFUSED_STATUS, bench_records, probe_times, sim_report


def _run(until_s: float | None = None):
    requests = mixed(30.0, 20.0, (("a", "critical", 0.3), ("b", "sheddable", 0.7)), seed=5)
    harness = Harness([replica_spec("r0"), replica_spec("r1")], controller(["r0", "r1"], default_tiers()))
    return harness.run(requests, events=[KillReplica(10.0, "r1")], until_s=until_s, probes_s=probe_times(20.0))


def test_each_outcome_has_the_status_a_client_would_see() -> None:
    result = _run()
    records = bench_records(result, target=0)
    assert len(records) == len(result.records)
    for sim, bench in zip(result.records, records):
        if sim.served:
            assert bench.status == 200 and bench.ok and bench.ttft_s == sim.ttft_s
            assert bench.e2e_s == sim.finish_s - sim.arrival_s and bench.completion_tokens == sim.output_tokens
        elif sim.refused_reason is not None:
            assert (bench.status, bench.reason) == (REFUSED_STATUS, sim.refused_reason)
        else:
            assert (bench.status, bench.reason) == (FAILED_STATUS, sim.failure_reason)
    statuses = {r.status for r in records}
    assert {200, REFUSED_STATUS, FAILED_STATUS} <= statuses  # 30 req/s overloads 2 replicas, one is killed


def test_requests_still_open_when_the_run_stops_are_unsettled_not_lost() -> None:
    records = bench_records(_run(until_s=15.0), target=0)
    open_ = [r for r in records if r.status == 0]
    assert open_ and all(r.reason == "unsettled" for r in open_)


def test_the_report_samples_the_killed_replica_as_idle() -> None:
    report, _ = sim_report({"overload control": _run()}, default_tiers(), pool="p", config={})
    busy = {m["t_s"]: m["value"] for m in report["metrics"]
            if m["series"] == 'tidegate_sim_replica_busy_ratio{pool="p",replica="r1"}'}
    assert busy[5.0] > 0.9 and busy[15.0] == 0.0
    assert report["timeline"][0] and report["tiers"][0]["name"] == "critical"


def test_probes_are_every_second_or_coarser_for_long_runs() -> None:
    assert probe_times(3.5) == (0.0, 1.0, 2.0, 3.0)
    long = probe_times(36_000.0)
    assert len(long) <= 601 and long[1] == 60.0
