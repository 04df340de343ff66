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
Logged steps can be fitted in a second form (`by_rows`): a step's fixed cost, its context, and the
cost of its forward pass by rows (prefill tokens + decoding sequences) point by point, in place of
a prefill token's cost and a decode table by batch. The engine computes a step's chunks and decodes
as one batch, so what a decode of a few sequences costs alone (a small matrix) is not what it adds
beside a prefill chunk; only logged steps mix the two, so a probe's samples cannot tell the forms
apart.
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
           "fit_with_held_out", "logged_step_s"]

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
    # what the decode attention read (logs written before the engine logged it: None): rows x
    # positions of K/V, by the mirror or a gather, after copying `copied_positions` into the mirror;
    # and the decodes' part of `context_tokens` (the rest is the prefill chunks')
    decode_context_tokens: int | None = None
    decode_rows: int | None = None
    decode_positions: int | None = None
    decode_path: str = ""
    copied_positions: int = 0
    start_s: float = 0.0  # when the step started, on the engine's clock (its variance in time: `sim.step_noise`)

    @property
    def shape(self) -> tuple[int, bool]:
        """What a held-out step is judged by, with the others like it: its decode batch, and whether a
        prefill chunk rode along (`fit_with_held_out`, `sim.held_out`)."""
        return (self.decodes, self.prefill_tokens > 0)

    @property
    def longest_decode_context(self) -> int:
        """The step's longest decode context, as the simulator knows it (0 where not logged): the
        positions the mirror's attention read (a gather's are that rounded up to a block)."""
        return (self.decode_positions or 0) if self.decodes else 0


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


def logged_step_s(model: StepCostModel, step: StepSample) -> float:
    """What the model predicts for a logged step, with its attention's shape where it was logged."""
    return model.step_s(step.prefill_tokens, step.decodes, step.context_tokens, step.longest_decode_context,
                        attention_rows=step.decode_rows, decode_context_tokens=step.decode_context_tokens)


def predict_s(fit: CostFit, sample: Sample, max_batch_tokens: int, attention_cost_tokens: int | None = None) -> float:
    """The sample's time as the fitted model (the simulator's) gives it."""
    model = fit.model
    if isinstance(sample, PrefillSample):
        return sum(model.step_s(tokens, 0, context)
                                         for tokens, context in prefill_steps(sample.prompt_tokens, max_batch_tokens,
                                                                                  attention_cost_tokens))
    if isinstance(sample, StepSample):
        return logged_step_s(model, sample)
    return model.step_s(0, sample.batch, sample.batch * (sample.context_tokens + 1.0))  # type: ignore[arg-type]


# where the forward table may have a point: every row count up to 8 (the small-matrix costs there
# are not monotone), then about a quarter apart; the points a fit uses are those with steps at or
# just above them
_ROW_LADDER = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512,
               640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192, 10240, 12288, 16384)


def _row_points(rows_seen: Sequence[int]) -> list[int]:
    """The forward table's points: each ladder point with steps in [it, the next one), and the
    largest row count seen (so that no point lacks the steps that determine it)."""
    seen = sorted(set(rows_seen))
    points = [low for low, high in zip(_ROW_LADDER, _ROW_LADDER[1:] + (10**9,))
              if any(low <= r < high for r in seen)]
    if seen and seen[-1] > points[-1]:
        points.append(seen[-1])
    return points


def _row_weights(rows: int, points: Sequence[int]) -> list[float]:
    """`rows` as `StepCostModel.forward_s` reads the table: linear between its two points, pro rata
    below the first, the last's past it."""
    weights = [0.0] * len(points)
    if rows <= points[0]:
        weights[0] = rows / points[0]
        return weights
    for index, (low, high) in enumerate(zip(points, points[1:])):
        if rows <= high:
            weights[index] = (high - rows) / (high - low)
            weights[index + 1] = (rows - low) / (high - low)
            return weights
    weights[-1] = 1.0
    return weights


def fit_cost_model(samples: Sequence[Sample], max_batch_tokens: int,
                   attention_cost_tokens: int | None = None, by_rows: bool = False,
                   decode_attention: bool = False) -> CostFit:
    """Least squares on relative error (relative to the model's prediction: see below), every cost
    >= 0 (a cost fitted negative is dropped to 0 and the rest refitted: noise must not make a longer
    batch cheaper).

    Unknowns: the fixed cost of a step, the cost of a prefill token and of a context token, and
    the decode cost at each batch size measured (`decode_s_by_batch`; the
    slope between its last two points carries it past them, as `decode_s_per_seq`).
    `decode_attention`: also a row x position of the batched decode attention
    (`StepCostModel.decode_attention_s_per_position`) and a prefill chunk's context token
    (`prefill_context_s_per_token`), from logged steps that carry their attention's shape (every
    one must); a probe's decode samples count batch x their context."""
    prefills = [s for s in samples if isinstance(s, PrefillSample)]
    decodes = [s for s in samples if isinstance(s, DecodeSample)]
    steps_logged = [s for s in samples if isinstance(s, StepSample)]
    if not steps_logged and (not prefills or not decodes):
        raise ValueError("need both prefill and decode samples, or logged steps")
    if decode_attention and any(s.decode_positions is None for s in steps_logged):
        raise ValueError("the decode attention's term needs step logs that carry each step's longest decode "
                         "context (an engine of this version's `--step-log`)")
    if by_rows:
        return _fit_by_rows(prefills, decodes, steps_logged, max_batch_tokens, attention_cost_tokens, decode_attention)
    if decode_attention:
        raise ValueError("the decode attention's term is fitted by rows only")
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
    coefficients = _relative_least_squares(rows, times)
    base, prefill, context = (float(c) for c in coefficients[:3])
    table = tuple((b, float(t)) for b, t in zip(batches, coefficients[3:]))
    return CostFit(StepCostModel(base, prefill, _slope_past(table), context, decode_s_by_batch=table))


def _fit_by_rows(prefills: Sequence[PrefillSample], decodes: Sequence[DecodeSample], steps_logged: Sequence[StepSample],
                 max_batch_tokens: int, attention_cost_tokens: int | None, decode_attention: bool = False) -> CostFit:
    """Unknowns: the fixed cost of a step, a context token's cost, and the forward pass's cost at
    each row count of `_row_points` (the smallest's is the fixed cost's: 0, else the two could not
    be told apart); with `decode_attention`, a prefill chunk context token's and a decode attention row x
    position's too (the last two columns)."""
    chunked = {s.prompt_tokens: prefill_steps(s.prompt_tokens, max_batch_tokens, attention_cost_tokens) for s in prefills}
    points = _row_points([t for steps in chunked.values() for t, _ in steps] + [s.batch for s in decodes]
                         + [s.prefill_tokens + s.decodes for s in steps_logged])
    rows, times = [], []
    attention = [0.0, 0.0] if decode_attention else []  # a prefill chunk's context token, a row x position
    for sample in prefills:
        steps = chunked[sample.prompt_tokens]
        weights = np.sum([_row_weights(tokens, points) for tokens, _ in steps], axis=0)
        rows.append([float(len(steps)), float(sum(c for _, c in steps))] + list(weights[1:])
                    + ([float(sum(c for _, c in steps)), 0.0] if attention else []))
        times.append(sample.ttft_s)
    for sample in decodes:
        positions = sample.batch * (sample.context_tokens + 1.0)  # every stream at the same context
        rows.append([1.0, positions] + _row_weights(sample.batch, points)[1:] + ([0.0, positions] if attention else []))
        times.append(sample.step_s)
    for logged in steps_logged:
        rows.append([1.0, float(logged.context_tokens)] + _row_weights(logged.prefill_tokens + logged.decodes, points)[1:]
                    + (_attention_columns(logged) if attention else []))
        times.append(logged.step_s)
    coefficients = _relative_least_squares(rows, times)
    base, context = (float(c) for c in coefficients[:2])
    prefill_context, per_position = (float(c) for c in coefficients[-2:]) if decode_attention else (0.0, 0.0)
    forward = coefficients[2:len(coefficients) - len(attention)]
    table = ((points[0], 0.0),) + tuple((r, float(t)) for r, t in zip(points[1:], forward))
    return CostFit(StepCostModel(base, 0.0, 0.0, context, forward_s_by_rows=table,
                                 forward_s_per_row=_slope_past(table), decode_attention_s_per_position=per_position,
                                 prefill_context_s_per_token=prefill_context))


def _attention_columns(step: StepSample) -> list[float]:
    """A logged step's prefill chunks' context and its decode attention's rows x longest context."""
    decode_context = step.decode_context_tokens if step.decode_context_tokens is not None else 0
    rows = step.decode_rows if step.decode_rows is not None else step.decodes
    return [float(step.context_tokens - decode_context), float(rows * step.longest_decode_context)]


def _relative_least_squares(rows: Sequence[Sequence[float]], times: Sequence[float]) -> np.ndarray:
    """Nonnegative least squares on relative error, each row's error relative to what the model
    predicts for it rather than to its own measured time: relative to its own time, a step that ran
    slow (the OS, a neighbour) counts for less than one that ran fast, and the fit comes out below
    the mean step. On the 9,329 steps two workers logged in one bench/sim_fidelity.py run it
    predicted their total 9.9 % short (a saturated replica modelled on it serves that much more than
    it did). A first pass scaled by the measured times gives the scales; the second fits with them.
    The first coefficient is a step's fixed cost, which must come out > 0."""
    times_s = np.asarray(times, dtype=np.float64)
    if (times_s <= 0).any():
        raise ValueError("measured times must be > 0")
    design = np.asarray(rows, dtype=np.float64)
    first = _nonnegative_least_squares(design / times_s[:, None], np.ones(len(times_s)))
    scales_s = np.maximum(design @ first, times_s.min())
    coefficients = _nonnegative_least_squares(design / scales_s[:, None], times_s / scales_s)
    if coefficients[0] <= 0:
        raise ValueError("the fit found no fixed cost per step: measure more shapes")
    return coefficients


def _slope_past(table: Sequence[tuple[int, float]]) -> float:
    """Past a table's last point: the slope of a line through its upper half (the last two points
    alone, a few logged steps each, once gave 5 ms a sequence where 0.9 was true)."""
    upper = [(b, t) for b, t in table if b >= table[-1][0] / 2]
    if len(upper) >= 2:
        return max(0.0, float(np.polyfit([b for b, _ in upper], [t for _, t in upper], 1)[0]))
    return table[-1][1] / table[-1][0]


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
                      attention_cost_tokens: int | None = None, by_rows: bool = False,
                      decode_attention: bool = False) -> tuple[CostFit, FitError]:
    """The fit on all samples, and the relative errors on every third sample of a fit without them
    (samples in the order given: pass them ordered by shape so the held-out ones interleave; logged
    steps are compared shape by shape, their mean time against the mean predicted)."""
    held_out = [s for i, s in enumerate(samples) if i % 3 == 2]
    fitted_on = [s for i, s in enumerate(samples) if i % 3 != 2]
    partial = fit_cost_model(fitted_on, max_batch_tokens, attention_cost_tokens, by_rows, decode_attention)
    errors = [abs(predict_s(partial, s, max_batch_tokens, attention_cost_tokens) / _measured_s(s) - 1.0)
              for s in held_out if not isinstance(s, StepSample)]
    # one logged step is noisy (the OS, the neighbours); a shape is the mean of its steps: by decode
    # batch and whether a prefill rode along, where at least 10 were held out
    shapes: dict[tuple[int, bool], list[float]] = {}
    for s in held_out:
        if isinstance(s, StepSample):
            totals = shapes.setdefault(s.shape, [0, 0.0, 0.0])
            totals[0] += 1
            totals[1] += predict_s(partial, s, max_batch_tokens, attention_cost_tokens)
            totals[2] += s.step_s
    errors += [abs(predicted / measured - 1.0) for count, predicted, measured in shapes.values() if count >= 10]
    error = FitError(len(errors), float(np.mean(errors)) if errors else float("nan"),
                     float(np.max(errors)) if errors else float("nan"), len(fitted_on))
    return fit_cost_model(samples, max_batch_tokens, attention_cost_tokens, by_rows, decode_attention), error


def _measured_s(sample: Sample) -> float:
    return sample.ttft_s if isinstance(sample, PrefillSample) else sample.step_s


def read_step_log(lines: Iterable[str]) -> list[StepSample]:
    """Steps from an engine's step log (`start_s,step_s,prefill_tokens,decodes,context_tokens`, then,
    in logs of engines that log it, `decode_context,decode_rows,decode_positions,decode_path,copied_positions`)."""
    steps = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            fields = line.strip().split(",")
            if len(fields) not in (5, 10):
                raise ValueError
            start_s, step_s, prefill, decodes, context = fields[:5]
            shape = {}
            if len(fields) == 10:
                decode_context, rows, positions, path, copied = fields[5:]
                if path not in ("", "mirror", "gather"):
                    raise ValueError
                shape = dict(decode_context_tokens=int(decode_context), decode_rows=int(rows),
                             decode_positions=int(positions), decode_path=path, copied_positions=int(copied))
            steps.append(StepSample(int(prefill), int(decodes), int(context), float(step_s), **shape,
                                    start_s=float(start_s)))
        except ValueError:
            raise ValueError(f"step log line {number}: expected start_s,step_s,prefill,decodes,context"
                             "[,decode_context,decode_rows,decode_positions,decode_path,copied_positions]") from None
    return steps
