"""Step-time noise: a seeded draw around the cost model's mean, fitted on logged steps."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tidegate.calibration import calibrate_from_step_logs
from tidegate.policy.pool import PoolController, PoolReplica
from tidegate.policy.tiers import default_tiers
from tidegate.sim.harness import Harness, KillReplica, RunResult, SlowReplica
from tidegate.sim.profile import ReplicaProfile, load_profile
from tidegate.sim.replica import StepCostModel
from tidegate.sim.scenarios import mixed, replica_spec
from tidegate.sim.step_noise import SharedDrift, StepNoise, StepNoiseStream
from tidegate.simulate import Simulation, poisson_requests

NOISE = StepNoise(sd=0.17, drift_share=0.55, drift_time_s=0.5, shared_share=0.3, shared_time_s=3.0)


def _run(noise: StepNoise | None, seed: int = 0, stretches: bool = True, replicas: int = 3) -> RunResult:
    requests = mixed(12.0, 30.0, (("a", "standard", 0.7), ("b", "critical", 0.3)), seed=5)
    specs = [replace(replica_spec(f"r{i}"), stretches=stretches, noise=noise, noise_seed=seed) for i in range(replicas)]
    controller = PoolController([PoolReplica(f"r{i}", 32, 16) for i in range(replicas)], default_tiers())
    return Harness(specs, controller).run(requests, (SlowReplica(8.0, "r1", 2.0), KillReplica(20.0, "r2")))


def _times(result: RunResult) -> list[tuple[float | None, float | None]]:
    return [(r.first_token_s, r.finish_s) for r in result.records]


def test_noise_of_no_spread_is_the_mean_model_exactly() -> None:
    assert _times(_run(replace(NOISE, sd=0.0))) == _times(_run(None))


def test_noise_moves_step_times_by_seed() -> None:
    flat, first, again, other = _run(None), _run(NOISE, 1), _run(NOISE, 1), _run(NOISE, 2)
    assert _times(first) == _times(again)
    assert _times(first) != _times(flat) and _times(first) != _times(other)


def test_noisy_stretches_draw_what_one_step_at_a_time_draws() -> None:
    """Arrivals cutting stretches, a slow-down and a death: each step draws by its number and
    start time, so the records match stepping one step at a time (to rounding)."""
    fast, slow = _run(NOISE, 3, stretches=True), _run(NOISE, 3, stretches=False)
    assert sum(r.steps for r in fast.replicas) == sum(r.steps for r in slow.replicas)
    for a, b in zip(fast.records, slow.records):
        assert a.replica_id == b.replica_id and a.failure_reason == b.failure_reason
        for name in ("first_token_s", "finish_s", "failed_s"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None) and (x is None or abs(x - y) < 1e-6), (a.request_id, name, x, y)


def test_a_busy_replicas_mean_multiplier_a_step_is_one_and_its_spread_the_noise_sd() -> None:
    """Steps back to back, each 50 ms times its multiplier: a fast spell holds more steps than a
    slow one, and still a step's mean multiplier is 1, as the fit made a logged step's."""
    stream = StepNoiseStream(NOISE, seed=4, replica_id="r0")
    state, logs, now_s = stream.committed, [], 0.0
    for step in range(100_000):  # about 5,000 s: thousands of the drifts' time constants
        factor, drift = stream.factor(step, now_s, state, now_s)
        state = (step + 1, now_s, drift)
        logs.append(math.log(factor))
        now_s += 0.05 * factor
    assert np.mean(np.exp(logs)) == pytest.approx(1.0, abs=0.01)
    assert np.std(logs) == pytest.approx(NOISE.sd, rel=0.05)


def test_replicas_of_a_run_share_its_shared_drift() -> None:
    shared = SharedDrift(NOISE, seed=0)
    values = [shared.at(0.1 * i, 0.0) for i in range(3000)]
    assert np.std(values) == pytest.approx(1.0, rel=0.15)  # a unit process over 100 time constants
    assert np.corrcoef(values[:-10], values[10:])[0, 1] == pytest.approx(math.exp(-1.0 / NOISE.shared_time_s), abs=0.1)
    noisy = Harness([replica_spec("r0"), replica_spec("r1")], PoolController(
        [PoolReplica("r0", 32, 16), PoolReplica("r1", 32, 16)], default_tiers()))
    assert noisy.replicas["r0"]._noise is None  # no noise in the spec: none drawn
    specs = [replace(replica_spec(f"r{i}"), noise=NOISE) for i in range(2)]
    harness = Harness(specs, PoolController([PoolReplica(f"r{i}", 32, 16) for i in range(2)], default_tiers()))
    streams = [harness.replicas[f"r{i}"]._noise for i in range(2)]
    assert streams[0] is not None and streams[1] is not None and streams[0]._shared is streams[1]._shared


def _synthetic_logs(tmp_path: Path, noise: StepNoise, steps: int = 6000) -> list[str]:
    """Two engines side by side, steps of a few shapes timed by a cost model times the noise."""
    cost = StepCostModel(base_s=0.015, prefill_s_per_token=0.0008, decode_s_per_seq=0.0012, context_s_per_token=5e-6)
    rng = np.random.default_rng(9)
    shared = SharedDrift(noise, seed=11)
    paths = []
    for engine in range(2):
        stream = StepNoiseStream(noise, 11, f"engine{engine}", shared)
        state, now_s, lines = stream.committed, 0.0, []
        for step in range(steps):
            prefill, decodes = int(rng.choice([0, 0, 32, 94])), int(rng.integers(1, 16))
            context = int(decodes * rng.integers(20, 300) + prefill)
            factor, drift = stream.factor(step, now_s, state)
            state = (step + 1, now_s, drift)
            step_s = cost.step_s(prefill, decodes, context) * factor
            lines.append(f"{now_s:.6f},{step_s:.6f},{prefill},{decodes},{context}")
            now_s += step_s + 0.0003
        path = tmp_path / f"steps-{engine}.csv"
        path.write_text("\n".join(lines) + "\n")
        paths.append(str(path))
    return paths


def test_calibration_recovers_the_noise_of_a_synthetic_log(tmp_path: Path) -> None:
    paths = _synthetic_logs(tmp_path, NOISE)
    profile = calibrate_from_step_logs(paths, name="synthetic", description="", step_noise=True)
    fitted = profile.noise
    assert fitted is not None
    assert fitted.sd == pytest.approx(NOISE.sd, rel=0.08)
    assert fitted.drift_share + fitted.shared_share == pytest.approx(NOISE.drift_share + NOISE.shared_share, abs=0.1)
    assert fitted.shared_share == pytest.approx(NOISE.shared_share, abs=0.12)
    assert fitted.drift_time_s == pytest.approx(NOISE.drift_time_s, rel=0.5)
    assert calibrate_from_step_logs(paths, name="synthetic", description="").noise is None  # only on request


def test_a_profile_keeps_its_noise_and_one_without_reads_as_before(tmp_path: Path) -> None:
    shipped_path = Path(__file__).resolve().parents[2] / "src/tidegate/sim/profiles/tiny-random-llama-cpu.json"
    text = shipped_path.read_text()
    plain = ReplicaProfile.from_json(text)
    assert plain.noise is None or plain.to_json() == text
    without = replace(plain, noise=None)
    assert "noise" not in without.to_json()
    noisy = replace(plain, noise=NOISE)
    again = ReplicaProfile.from_json(noisy.to_json())
    assert again.noise == NOISE and again.spec("r0", noise_seed=7).noise_seed == 7


def test_same_seed_same_report_bytes_other_seed_other(tmp_path: Path) -> None:
    profile = replace(load_profile("tiny-random-llama-cpu"), noise=NOISE)
    simulation = Simulation(profile=profile, replicas=2)
    requests = poisson_requests(5.0, 40.0, seed=3)
    written = []
    for label, seed in (("a", 1), ("b", 1), ("c", 2)):
        out = simulation.write({"sim": simulation.run(requests, noise_seed=seed, probe=False)}, tmp_path / label,
                               plots=False)
        written.append(out.read_bytes())
    assert written[0] == written[1] and written[0] != written[2]


def test_the_vm_profile_is_the_default_with_its_measured_noise() -> None:
    """`tiny-random-llama-cpu-vm` ships the default's cost model with the noise of the VM it was
    measured on; the default stays the mean model (fleets, speed). A refit of one must reach the other."""
    default, vm = load_profile("tiny-random-llama-cpu"), load_profile("tiny-random-llama-cpu-vm")
    assert default.noise is None and vm.noise is not None and vm.noise.sd > 0
    assert replace(vm, name=default.name, description=default.description, noise=None) == default
