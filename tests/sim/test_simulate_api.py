"""The simulator's Python API: what a notebook does, end to end."""

from __future__ import annotations

import json

import pytest

from tidegate.sim.harness import KillReplica
from tidegate.simulate import Simulation, poisson_requests, trace_requests


def test_a_config_file_a_trace_and_two_arms_make_one_report(tmp_path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("pools: [{name: chat, backends: [{type: embedded, model: tiny-random-llama, count: 3}]}]\n")
    simulation = Simulation(config, profile="tiny-random-llama-cpu")
    assert simulation.replica_ids == ["r0", "r1", "r2"] and simulation.pool.name == "chat"
    requests = trace_requests(speedup=60, duration_s=30, mix={"critical": 0.25, "standard": 0.75}, seed=1)
    assert {r.tier for r in requests} == {"critical", "standard"}
    controlled = simulation.run(requests, events=[KillReplica(10.0, "r2")])
    fifo = simulation.run(requests, fifo=True)
    assert not controlled.summary.replicas[2].alive and fifo.summary.replicas[2].alive
    served = sum(t.served for t in controlled.summary.tiers)
    assert served > 0 and sum(t.arrived for t in controlled.summary.tiers) == len(requests)
    path = simulation.write({"overload control": controlled, "FIFO": fifo}, tmp_path / "out", plots=False)
    report = json.loads(path.read_text())
    assert report["targets"] == ["overload control", "FIFO"] and report["config"]["pool"] == "chat"
    overall = next(s for s in report["summaries"] if s["target"] == 0 and s["tier"] == "all")
    assert overall["succeeded"] == served


def test_a_tier_the_config_does_not_define_is_refused_before_the_run() -> None:
    simulation = Simulation(replicas=1)
    with pytest.raises(ValueError, match="unknown tier 'gold'"):
        simulation.run(poisson_requests(1.0, 5.0, mix={"gold": 1.0}))
    with pytest.raises(ValueError, match="replicas"):
        Simulation(replicas=0)


def test_the_simulated_pool_reads_prefix_affinity_as_serve_does(tmp_path) -> None:
    from tidegate.config import load_config
    from tidegate.simulate import pool_controller

    pools = "pools: [{name: chat, backends: [{type: embedded, model: tiny-random-llama, count: 1}]}]\n"
    for limits, blocks in (("", 32768 * 4 // 64), ("limits: {prefix_cache_tokens: 0}\n", 0),
                           ("limits: {prefix_cache_tokens: 1024}\n", 1024 * 4 // 64)):
        config = tmp_path / "serve.yaml"
        config.write_text(pools + limits)
        controller, _ = pool_controller(load_config(config), None, ["r0"])
        assert controller.prefix_index_blocks("r0") == blocks, limits


def test_the_simulated_pool_routes_by_length_class_as_serve_does(tmp_path) -> None:
    from tidegate.config import load_config
    from tidegate.simulate import pool_controller
    from tidegate.types import PoolRequest

    config = tmp_path / "serve.yaml"
    config.write_text("pools: [{name: chat, backends: [{type: embedded, model: tiny-random-llama, count: 2}],\n"
                      "         length_classes: [{max_prompt_tokens: 500, replicas: [0]}, {replicas: [1]}]}]\n")
    controller, _ = pool_controller(load_config(config), None, ["r0", "r1"])
    placed = []
    for number, prompt_tokens in enumerate((100, 2000, 300, 4000)):
        decision = controller.on_arrival(0.0, PoolRequest(number, 0.0, "t", "standard", prompt_tokens, 20))
        placed.append(decision.assignment.replica_id)
    assert placed == ["r0", "r1", "r0", "r1"]
