"""Replica profiles as files, and the cost model fitted back from step times."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tidegate.sim.costfit import DecodeSample, PrefillSample, fit_cost_model, fit_with_held_out, predict_s, CostFit
from tidegate.sim.harness import Harness
from tidegate.sim.fifo import FifoDispatcher
from tidegate.sim.capacity import patient_tiers
from tidegate.sim.profile import ReplicaProfile, load_profile, save_profile, shipped_profiles
from tidegate.sim.replica import StepCostModel
from tidegate.sim.seam import SimRequest

TRUE = StepCostModel(base_s=0.014, prefill_s_per_token=0.0012, decode_s_per_seq=0.0013, context_s_per_token=6e-6)
BUDGET = 96


def test_every_shipped_profile_loads_and_names_its_sources() -> None:
    names = shipped_profiles()
    assert "tiny-random-llama-cpu" in names and "llama-3-8b-h100-80gb" in names
    for name in names:
        profile = load_profile(name)
        assert profile.name == name and profile.sources
        assert profile.estimate == ("estimate" in profile.description)  # labelled where it is one
        assert profile.spec("r0").scheduler.max_batch_tokens == profile.max_batch_tokens


def test_a_profile_survives_a_round_trip_through_its_file(tmp_path) -> None:
    profile = load_profile("llama-3-8b-a100-80gb")
    save_profile(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile


def test_a_bad_profile_is_refused_with_its_path(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "name": "x"}')
    with pytest.raises(ValueError, match="bad.json"):
        load_profile(bad)
    with pytest.raises(ValueError, match="no shipped profile"):
        load_profile("no-such-profile")


def test_a_prompt_alone_takes_in_the_simulator_what_the_fit_predicts_for_it() -> None:
    """costfit chunks a prompt as the modelled replica does: same scheduler, same costs (the
    profile's mean: its step noise, drawn around it, is `test_step_noise`'s)."""
    profile = replace(load_profile("tiny-random-llama-cpu"), noise=None)
    fit = CostFit(profile.cost)
    for tokens in (1, 40, 96, 97, 250, 1000):
        result = Harness([profile.spec("r0")], FifoDispatcher(["r0"], patient_tiers(), slot_limit=1)).run(
            [SimRequest(0, 0.0, "t", "standard", tokens, 1)])
        ttft_s = result.records[0].ttft_s
        assert ttft_s == pytest.approx(predict_s(fit, PrefillSample(tokens, 1.0), profile.max_batch_tokens,
                                                 profile.attention_cost_tokens), rel=1e-9)


def _samples(noise: float, seed: int = 0) -> list[PrefillSample | DecodeSample]:
    rng = np.random.default_rng(seed)
    truth = CostFit(TRUE)
    samples: list[PrefillSample | DecodeSample] = []
    for tokens in (8, 32, 64, 96, 160, 256, 384):
        samples.append(PrefillSample(tokens, 1.0))
    for context in (16, 256):
        for batch in (1, 2, 4, 8, 16, 32):
            samples.append(DecodeSample(batch, context + 12.0, 1.0))
    out = []
    for s in samples:
        t = predict_s(truth, s, BUDGET) * (1 + noise * rng.standard_normal())
        out.append(PrefillSample(s.prompt_tokens, t) if isinstance(s, PrefillSample)
                   else DecodeSample(s.batch, s.context_tokens, t))
    return out


def test_the_fit_recovers_the_costs_that_made_the_step_times() -> None:
    fit = fit_cost_model(_samples(0.0), BUDGET)
    for name in ("base_s", "prefill_s_per_token", "decode_s_per_seq", "context_s_per_token"):
        assert getattr(fit.model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)


def test_with_noisy_times_the_held_out_shapes_are_predicted_within_their_noise() -> None:
    fit, error = fit_with_held_out(_samples(0.03), BUDGET)
    assert error.held_out_samples == 6 and error.fitted_samples == 13
    assert error.held_out_max < 0.1
    assert min(fit.model.base_s, fit.model.prefill_s_per_token, fit.model.decode_s_per_seq) > 0


def test_a_cost_fitted_negative_is_held_at_zero() -> None:
    # decode steps that do not grow with context: the context cost would come out slightly negative
    samples = [s if isinstance(s, PrefillSample) else DecodeSample(s.batch, s.context_tokens,
                                                                    0.014 + 0.0013 * s.batch)
               for s in _samples(0.0)]
    fit = fit_cost_model(samples, BUDGET)
    assert fit.model.context_s_per_token >= 0 and fit.model.base_s > 0


def test_a_measured_decode_table_is_interpolated_and_carried_past_its_ends() -> None:
    cost = StepCostModel(base_s=0.01, decode_s_per_seq=0.001, context_s_per_token=0.0,
                         decode_s_by_batch=((2, 0.008), (4, 0.016), (8, 0.006)))
    assert cost.decode_s(1) == pytest.approx(0.004)  # pro rata below the first point
    assert cost.decode_s(3) == pytest.approx(0.012)
    assert cost.decode_s(6) == pytest.approx(0.011)  # not monotone: as measured
    assert cost.decode_s(10) == pytest.approx(0.008)  # past the last: decode_s_per_seq a sequence
    assert cost.step_s(0, 0, 0) == pytest.approx(0.01)


def test_a_table_out_of_order_is_refused() -> None:
    profile = load_profile("tiny-random-llama-cpu")
    with pytest.raises(ValueError, match="increasing"):
        ReplicaProfile(**{**{f: getattr(profile, f) for f in profile.__slots__},
                          "cost": StepCostModel(decode_s_by_batch=((4, 0.01), (2, 0.02)))})


def _random_step_shape(rng: np.random.Generator) -> tuple[int, int, int]:
    """(prefill tokens, decoding sequences, context tokens) of a step, as an engine's log mixes them."""
    prefill = int(rng.choice([0, 0, 40, 96]))
    decodes = int(rng.integers(0 if prefill else 1, 33))
    return prefill, decodes, int(decodes * rng.integers(20, 300) + prefill * 2)


def test_logged_steps_fit_the_costs_that_made_them(tmp_path) -> None:
    """`tidegate sim calibrate --step-log`: a log written as the engine writes it, read back, fitted."""
    from tidegate.cli import main

    rng = np.random.default_rng(3)
    lines = []
    for index in range(3000):
        prefill, decodes, context = _random_step_shape(rng)
        step_s = TRUE.step_s(prefill, decodes, context) * (1 + 0.02 * rng.standard_normal())
        lines.append(f"{index * 0.1:.6f},{step_s:.6f},{prefill},{decodes},{context}")
    log = tmp_path / "steps.csv"
    log.write_text("\n".join(lines) + "\n")
    assert main(["sim", "calibrate", "--step-log", str(log), "--out", str(tmp_path / "p.json")]) == 0
    cost = load_profile(tmp_path / "p.json").cost
    assert cost.forward_s_by_rows  # logged steps are fitted by their forward pass's rows
    for prefill, decodes, context in ((0, 1, 50), (0, 16, 3000), (40, 0, 80), (96, 0, 192), (40, 8, 1500)):
        assert cost.step_s(prefill, decodes, context) == pytest.approx(TRUE.step_s(prefill, decodes, context), rel=0.05)
    fit = load_profile(tmp_path / "p.json").fit
    assert fit is not None and fit.held_out_max < 0.05  # shapes: means of many steps


def test_a_bad_step_log_line_is_named() -> None:
    from tidegate.sim.costfit import read_step_log

    with pytest.raises(ValueError, match="line 2"):
        read_step_log(["0.1,0.02,0,4,100", "oops"])


def test_logged_steps_with_slow_outliers_fit_their_mean_not_their_typical_step() -> None:
    """A step that ran slow (the OS, a neighbour) weighs as much as one that ran fast: the fit
    predicts the steps' total time, which sets how much a replica serves. Scaled by each step's own
    time, the fit came out ~10 % short on a real run's steps, and on these."""
    from tidegate.sim.costfit import StepSample

    rng = np.random.default_rng(11)
    steps = []
    for _ in range(4000):
        prefill, decodes, context = _random_step_shape(rng)
        slow = rng.lognormal(0.0, 0.35)  # skewed: most steps near their cost, a few far above it
        steps.append(StepSample(prefill, decodes, context, TRUE.step_s(prefill, decodes, context) * slow))
    fit = fit_cost_model(steps, BUDGET)
    predicted = sum(predict_s(fit, s, BUDGET) for s in steps)
    assert predicted == pytest.approx(sum(s.step_s for s in steps), rel=0.02)


# a forward pass's cost by its rows as tiny-random-llama's (1 thread) measured: 2-7 rows cost more
# than 8 (torch's small-matrix kernels), then about a millisecond a row
ROWS_TRUE = StepCostModel(base_s=0.019, prefill_s_per_token=0.0, decode_s_per_seq=0.0, context_s_per_token=8e-9,
                          forward_s_by_rows=((1, 0.0), (2, 0.009), (4, 0.022), (7, 0.029), (8, 0.0047), (16, 0.012),
                                             (32, 0.034), (96, 0.091)), forward_s_per_row=0.00095)


def _steps_of_an_engine(cost: StepCostModel, count: int, seed: int):
    """Steps as the engine logs them: decodes alone, decodes with a prefill chunk, chunks alone."""
    from tidegate.sim.costfit import StepSample

    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(count):
        decodes = int(rng.integers(0, 33))
        prefill = int(rng.integers(8, BUDGET - decodes + 1)) if decodes == 0 or rng.random() < 0.4 else 0
        context = decodes * int(rng.integers(20, 300)) + prefill * 2
        steps.append(StepSample(prefill, decodes, context, cost.step_s(prefill, decodes, context)
                                * (1 + 0.02 * rng.standard_normal())))
    return steps


def test_a_forward_table_costs_a_step_by_its_rows_whatever_they_compute() -> None:
    cost = ROWS_TRUE
    assert cost.step_s(0, 4, 0) == pytest.approx(0.019 + 0.022)  # four decodes: four rows
    assert cost.step_s(3, 1, 0) == cost.step_s(0, 4, 0)  # a chunk of three and a decode: four too
    assert cost.forward_s(24) == pytest.approx(0.012 + (0.034 - 0.012) * 8 / 16)  # between two points
    assert cost.forward_s(100) == pytest.approx(0.091 + 4 * 0.00095)  # past the last: its slope
    assert cost.step_s(0, 0, 1000) == pytest.approx(0.019 + 1000 * 8e-9)


def test_steps_mixing_a_chunk_and_a_few_decodes_fit_by_the_forward_pass_rows() -> None:
    """The engine computes a step's chunk and its decodes as one batch of rows: three decodes cost
    what three rows cost alone, and next to a chunk of 40 tokens what rows 41-43 add. A decode table
    by batch cannot fit both (on a live run's steps it missed steps with 3-7 decodes and a chunk by
    6-16 %); a table by rows does."""
    steps = _steps_of_an_engine(ROWS_TRUE, 6000, seed=5)
    mixed_few = [s for s in steps if s.prefill_tokens and 3 <= s.decodes <= 7]
    truth = sum(ROWS_TRUE.step_s(s.prefill_tokens, s.decodes, s.context_tokens) for s in mixed_few)
    by_rows = fit_cost_model(steps, BUDGET, by_rows=True)
    assert sum(predict_s(by_rows, s, BUDGET) for s in mixed_few) == pytest.approx(truth, rel=0.02)
    for rows in (1, 3, 5, 8, 20, 60, 90):
        assert by_rows.model.step_s(0, 0, 0) + by_rows.model.forward_s(rows) == pytest.approx(
            ROWS_TRUE.step_s(rows, 0, 0), rel=0.03)
    by_batch = fit_cost_model(steps, BUDGET)
    assert abs(sum(predict_s(by_batch, s, BUDGET) for s in mixed_few) / truth - 1) > 0.05


def test_a_forward_table_survives_a_profile_file_and_old_profiles_read_as_before(tmp_path) -> None:
    profile = load_profile("tiny-random-llama-cpu-probed")
    assert not profile.cost.forward_s_by_rows and "forward_s_by_rows" not in profile.to_json()
    with_rows = ReplicaProfile(**{**{f: getattr(profile, f) for f in profile.__slots__}, "cost": ROWS_TRUE})
    save_profile(with_rows, tmp_path / "rows.json")
    assert load_profile(tmp_path / "rows.json") == with_rows
    with pytest.raises(ValueError, match="forward_s_by_rows"):
        ReplicaProfile(**{**{f: getattr(profile, f) for f in profile.__slots__},
                          "cost": StepCostModel(forward_s_by_rows=((8, 0.01), (4, 0.02)))})


def test_a_gzipped_step_log_fits_as_the_plain_one(tmp_path) -> None:
    """The shipped profile's steps are kept gzip'd beside the benches, to be refitted."""
    import gzip

    from tidegate.calibration import calibrate_from_step_logs

    lines = "".join(f"{i * 0.1:.6f},{s.step_s:.6f},{s.prefill_tokens},{s.decodes},{s.context_tokens}\n"
                    for i, s in enumerate(_steps_of_an_engine(ROWS_TRUE, 600, seed=9)))
    (tmp_path / "steps.csv").write_text(lines)
    (tmp_path / "steps.csv.gz").write_bytes(gzip.compress(lines.encode()))
    plain, zipped = (calibrate_from_step_logs([str(tmp_path / name)], name="p", description="")
                     for name in ("steps.csv", "steps.csv.gz"))
    assert zipped.cost == plain.cost and zipped.cost.forward_s_by_rows


def test_the_decode_attention_costs_decodes_x_the_longest_context_not_the_summed_one() -> None:
    """The engine's decode attention reads every decoding row up to the step's longest context
    (bench/decode_attention_grid.py): one long decode among short ones costs as if all were long."""
    from tidegate.engine.scheduler import ScheduledBatch, ScheduledChunk
    from tidegate.engine.sequence import SamplingParams, Sequence

    cost = StepCostModel(base_s=0.01, prefill_s_per_token=0.0, decode_s_per_seq=0.001, context_s_per_token=0.0,
                         decode_attention_s_per_position=1e-6)
    assert cost.step_s(0, 8, 8 * 300, 300) == pytest.approx(0.01 + 0.008 + 8 * 300 * 1e-6)
    seqs = [Sequence(seq_id=i, prompt_token_ids=[1] * 4, params=SamplingParams(max_tokens=4)) for i in range(3)]
    batch = ScheduledBatch(tuple(ScheduledChunk(seq, start, 1, True) for seq, start in zip(seqs, (499, 19, 9))), 3)
    assert cost.batch_step_s(batch) == pytest.approx(0.01 + 0.003 + 3 * 500 * 1e-6)


def test_logged_decode_attention_shapes_fit_a_cost_a_position_apart_from_the_summed_context() -> None:
    """Steps of a true model with the decode attention's term: where every decode has about the
    same context the two terms move together, so the steps mix long and short contexts, as served
    traffic does; the fit finds the term, and the old form (context only) misses the long steps."""
    from tidegate.sim.costfit import StepSample

    truth = replace(ROWS_TRUE, context_s_per_token=2e-6, decode_attention_s_per_position=4e-6)
    rng = np.random.default_rng(21)
    steps = []
    for _ in range(5000):
        decodes = int(rng.integers(0, 33))
        prefill = int(rng.integers(8, BUDGET - decodes + 1)) if decodes == 0 or rng.random() < 0.4 else 0
        contexts = rng.integers(20, 600, size=decodes)
        longest = int(contexts.max()) if decodes else 0
        context = int(contexts.sum()) + prefill * 2
        step_s = truth.step_s(prefill, decodes, context, longest) * (1 + 0.02 * rng.standard_normal())
        steps.append(StepSample(prefill, decodes, context, step_s, int(contexts.sum()), decodes, longest,
                                "mirror" if decodes else "", 0))
    fit = fit_cost_model(steps, BUDGET, by_rows=True, decode_attention=True).model
    assert fit.decode_attention_s_per_position == pytest.approx(4e-6, rel=0.1)
    long_steps = [s for s in steps if s.decodes >= 16]
    truth_s = sum(s.step_s for s in long_steps)
    assert sum(predict_s(CostFit(fit), s, BUDGET) for s in long_steps) == pytest.approx(truth_s, rel=0.02)
    with pytest.raises(ValueError, match="longest decode context"):
        fit_cost_model([replace(s, decode_positions=None) for s in steps], BUDGET, by_rows=True, decode_attention=True)


def test_a_step_log_with_the_decode_attention_s_shape_reads_and_a_bad_path_is_named() -> None:
    from tidegate.sim.costfit import read_step_log

    old, new = read_step_log(["0.1,0.02,0,4,100", "0.2,0.03,40,4,300,100,6,31,mirror,120"])
    assert old.decode_positions is None and old.longest_decode_context == 0
    assert (new.decode_rows, new.decode_positions, new.decode_path, new.copied_positions) == (6, 31, "mirror", 120)
    assert new.longest_decode_context == 31
    with pytest.raises(ValueError, match="line 1"):
        read_step_log(["0.2,0.03,40,4,300,100,6,31,sideways,120"])
