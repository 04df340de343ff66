"""Fitting the step cost model to what a running engine was measured to do.

Two kinds of measurement, both readable from outside any OpenAI-compatible engine:
- a prompt of N tokens sent alone: its time to first token is the sum of the steps that prefilled
  it. Which steps those are (chunks of the token budget) comes from the engine's own scheduler,
  run here on the same shape, so the fit and the simulator chunk alike;
- B streams decoding together at a context of C tokens: the gap between two tokens of a stream is
  one decode step of batch B.
Each is linear in the model's costs (`StepCostModel`: a step's fixed cost, a prefill token's, a
context token's, and the decode batch's at each batch size measured), so they are fitted together
by least squares on relative error (a 15 ms step counts as much as a 1 s prefill), costs kept >= 0,
each sample's error relative to what the model predicts for it (so that the fit predicts the mean
time of a shape, not less: a throughput is a sum of step times).
A measured TTFT also carries the request's trip through HTTP (about a millisecond here): it is not
fitted apart, since with prompts of one step it cannot be told from a step's fixed cost, and
trying made the fixed cost come out 0 on tiny-random-llama. It counts in the fixed cost.
A third kind needs no probing: the steps an engine logged while serving (`tidegate engine
--step-log`), each its own row. They carry what a probe from outside cannot: the engine's speed
under its real load, beside the gateway and its neighbours (on the 2-core test machine the live
steps of two busy workers ran 8-29 % slower than the probes of one had measured).
How well the model predicts shapes it was not fitted on is measured by holding every third
sample out, fitting on the rest; the profile is then fitted on all of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tidegate.engine.kv_cache import BlockManager
from tidegate.engine.scheduler import Scheduler, SchedulerConfig
from tidegate.engine.sequence import SamplingParams
from tidegate.engine.sequence import Sequence as EngineSequence
from tidegate.sim.profile import FitError
from tidegate.sim.replica import StepCostModel

__all__ = ["PrefillSample", "DecodeSample", "StepSample", "read_step_log", "CostFit", "prefill_steps", "fit_cost_model", "predict_s",
           "fit_with_held_out"]

_PROMPT_TOKEN = 7  # any token: a modelled prompt's content does not matter


@dataclass(frozen=True, slots=True)
class PrefillSample:
    prompt_tokens: int
    ttft_s: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    batch: int  # sequences decoding together
    context_tokens: float  # mean context of a sequence over the measured steps (prompt + output so far)
    step_s: float


@dataclass(frozen=True, slots=True)
class StepSample:
    """One step an engine logged (`tidegate engine --step-log`): what it computed and how long."""

    prefill_tokens: int
    decodes: int
    context_tokens: int  # summed over the step's sequences: each one's last position + 1
    step_s: float


Sample = PrefillSample | DecodeSample | StepSample


@dataclass(frozen=True, slots=True)
class CostFit:
    model: StepCostModel


def prefill_steps(prompt_tokens: int, max_batch_tokens: int,
                  attention_cost_tokens: int | None = None) -> list[tuple[int, int]]:
    """(prefill tokens, summed context) of each step that prefills a prompt sent alone, as the
    engine's scheduler chunks it."""
    config = SchedulerConfig(max_num_seqs=1, max_batch_tokens=max_batch_tokens,
                             attention_cost_tokens=attention_cost_tokens)
    scheduler = Scheduler(config, BlockManager(prompt_tokens + 64))
    scheduler.add(EngineSequence(seq_id=0, prompt_token_ids=[_PROMPT_TOKEN] * prompt_tokens,
                                 params=SamplingParams(max_tokens=1, ignore_eos=True)))
    steps = []
    while scheduler.has_work:
        batch = scheduler.schedule()
        steps.append((sum(c.num_tokens for c in batch.chunks), sum(c.start + c.num_tokens for c in batch.chunks)))
        scheduler.update(batch, [_PROMPT_TOKEN for c in batch.chunks if c.samples])
    return steps


def predict_s(fit: CostFit, sample: Sample, max_batch_tokens: int, attention_cost_tokens: int | None = None) -> float:
    """The sample's time as the fitted model (the simulator's) gives it."""
    model = fit.model
    if isinstance(sample, PrefillSample):
        return sum(model.step_s(tokens, 0, context)
                                         for tokens, context in prefill_steps(sample.prompt_tokens, max_batch_tokens,
                                                                                  attention_cost_tokens))
    if isinstance(sample, StepSample):
        return model.step_s(sample.prefill_tokens, sample.decodes, sample.context_tokens)
    return model.step_s(0, sample.batch, sample.batch * (sample.context_tokens + 1.0))  # type: ignore[arg-type]


def fit_cost_model(samples: Sequence[Sample], max_batch_tokens: int,
                   attention_cost_tokens: int | None = None) -> CostFit:
    """Least squares on relative error (relative to the model's prediction: see below), every cost
    >= 0 (a cost fitted negative is dropped to 0 and the rest refitted: noise must not make a longer
    batch cheaper).

    Unknowns: the fixed cost of a step, the cost of a prefill token and of a context token, and
    the decode cost at each batch size measured (`decode_s_by_batch`; the
    slope between its last two points carries it past them, as `decode_s_per_seq`)."""
    prefills = [s for s in samples if isinstance(s, PrefillSample)]
    decodes = [s for s in samples if isinstance(s, DecodeSample)]
    steps_logged = [s for s in samples if isinstance(s, StepSample)]
    if not steps_logged and (not prefills or not decodes):
        raise ValueError("need both prefill and decode samples, or logged steps")
    batches = sorted({s.batch for s in decodes} | {s.decodes for s in steps_logged if s.decodes > 0})
    rows, times = [], []
    for sample in prefills:
        steps = prefill_steps(sample.prompt_tokens, max_batch_tokens, attention_cost_tokens)
        rows.append([float(len(steps)), float(sum(t for t, _ in steps)), float(sum(c for _, c in steps))]
                    + [0.0] * len(batches))
        times.append(sample.ttft_s)
    for sample in decodes:
        one_hot = [1.0 if b == sample.batch else 0.0 for b in batches]
        rows.append([1.0, 0.0, sample.batch * (sample.context_tokens + 1.0)] + one_hot)
        times.append(sample.step_s)
    for logged in steps_logged:
        rows.append([1.0, float(logged.prefill_tokens), float(logged.context_tokens)]
                    + [1.0 if b == logged.decodes else 0.0 for b in batches])
        times.append(logged.step_s)
    times_s = np.asarray(times, dtype=np.float64)
    if (times_s <= 0).any():
        raise ValueError("measured times must be > 0")
    design = np.asarray(rows, dtype=np.float64)
    # relative error, each row scaled by what the model predicts for it rather than by its own
    # measured time: scaled by its own time, a step that ran slow (the OS, a neighbour) counts for
    # less than one that ran fast, and the fit comes out below the mean step. On the 9,329 steps
    # two workers logged in one bench/sim_fidelity.py run it predicted their total 9.9 % short (a
    # saturated replica modelled on it serves that much more than it did). A first pass scaled by
    # the measured times gives the scales; the second fits with them
    first = _nonnegative_least_squares(design / times_s[:, None], np.ones(len(times_s)))
    scales_s = np.maximum(design @ first, times_s.min())
    coefficients = _nonnegative_least_squares(design / scales_s[:, None], times_s / scales_s)
    base, prefill, context = (float(c) for c in coefficients[:3])
    if base <= 0:
        raise ValueError("the fit found no fixed cost per step: measure more shapes")
    table = tuple((b, float(t)) for b, t in zip(batches, coefficients[3:]))
    # past the largest batch measured: the slope of a line through the upper half of the table (the
    # last two points alone, a few logged steps each, once gave 5 ms a sequence where 0.9 was true)
    upper = [(b, t) for b, t in table if b >= table[-1][0] / 2]
    if len(upper) >= 2:
        per_seq = max(0.0, float(np.polyfit([b for b, _ in upper], [t for _, t in upper], 1)[0]))
    else:
        per_seq = table[-1][1] / table[-1][0]
    return CostFit(StepCostModel(base, prefill, per_seq, context, decode_s_by_batch=table))


def _nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: one fitted negative is dropped (held at 0) and
    the rest refitted."""
    free = list(range(design.shape[1]))
    coefficients = np.zeros(design.shape[1])
    while free:
        solution, *_ = np.linalg.lstsq(design[:, free], target, rcond=None)
        if (solution >= 0).all():
            coefficients[free] = solution
            break
        del free[int(np.argmin(solution))]
    return coefficients


def fit_with_held_out(samples: Sequence[Sample], max_batch_tokens: int,
                      attention_cost_tokens: int | None = None) -> tuple[CostFit, FitError]:
    """The fit on all samples, and the relative errors on every third sample of a fit without them
    (samples in the order given: pass them ordered by shape so the held-out ones interleave; logged
    steps are compared shape by shape, their mean time against the mean predicted)."""
    held_out = [s for i, s in enumerate(samples) if i % 3 == 2]
    fitted_on = [s for i, s in enumerate(samples) if i % 3 != 2]
    partial = fit_cost_model(fitted_on, max_batch_tokens, attention_cost_tokens)
    errors = [abs(predict_s(partial, s, max_batch_tokens, attention_cost_tokens) / _measured_s(s) - 1.0)
              for s in held_out if not isinstance(s, StepSample)]
    # one logged step is noisy (the OS, the neighbours); a shape is the mean of its steps: by decode
    # batch and whether a prefill rode along, where at least 10 were held out
    shapes: dict[tuple[int, bool], list[float]] = {}
    for s in held_out:
        if isinstance(s, StepSample):
            totals = shapes.setdefault((s.decodes, s.prefill_tokens > 0), [0, 0.0, 0.0])
            totals[0] += 1
            totals[1] += predict_s(partial, s, max_batch_tokens, attention_cost_tokens)
            totals[2] += s.step_s
    errors += [abs(predicted / measured - 1.0) for count, predicted, measured in shapes.values() if count >= 10]
    error = FitError(len(errors), float(np.mean(errors)) if errors else float("nan"),
                     float(np.max(errors)) if errors else float("nan"), len(fitted_on))
    return fit_cost_model(samples, max_batch_tokens, attention_cost_tokens), error


def _measured_s(sample: Sample) -> float:
    return sample.ttft_s if isinstance(sample, PrefillSample) else sample.step_s


def read_step_log(lines: Iterable[str]) -> list[StepSample]:
    """Steps from an engine's step log (`start_s,step_s,prefill_tokens,decodes,context_tokens`)."""
    steps = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            _, step_s, prefill, decodes, context = line.split(",")
            steps.append(StepSample(int(prefill), int(decodes), int(context), float(step_s)))
        except ValueError:
            raise ValueError(f"step log line {number}: expected start_s,step_s,prefill,decodes,context") from None
    return steps
