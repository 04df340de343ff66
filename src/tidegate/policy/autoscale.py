"""How many replicas a pool should have: reactive, panic and predictive layers. Pure: signals in,
decision out, time passed in; `on_tick` is the only method that changes state.

The unit is concurrency demand: requests on the replicas plus requests queued for them (Little's
law: what the pool must hold at once to keep up), scaled up by the share of arrivals refused
(`test_arrivals_refused_at_once_count_as_demand_the_fleet_did_not_hold`); or, when the replica's
token throughput is known (`replica_tokens_per_s` as set, else measured from the work served while
the pool is saturated: `policy.throughput`), the work arriving in slots' worth, which does not
inflate near saturation as requests held do
(`test_work_demand_does_not_grow_with_the_time_requests_are_held`). A replica holds
`slots_per_replica` requests at its latency target; the pool aims to run them at
`target_utilisation`, the headroom absorbing a rise while new capacity starts. Layers (the highest
wins, then the bounds), each with the test that fails without it; the runs behind them are in
docs/autoscaling.md:
- reactive (Knative's stable window, HPA's formula): desired = ceil(mean demand over the stable
  window / (slots x target)); a scale-out it asks for is at most `scale_up_step` of the current
  fleet (at least one replica), so one noisy window cannot double the fleet
  (`test_steady_demand_asks_for_demand_over_the_target_slots`,
  `test_a_rising_average_adds_at_most_a_quarter_of_the_fleet_per_decision`);
- triggers (the seeds' rules): queued requests over `queue_trigger`, or the worst tier's P99 TTFT
  over `latency_trigger` x its target, ask for one step more than the current fleet, once nothing
  is starting (`test_a_queue_trigger_waits_for_the_replicas_it_started`) and the ready count has
  held for a panic window (`test_a_trigger_waits_for_the_replicas_it_got_to_serve`); at the edge the
  latency trigger is judged on a tenth of the ticks since then
  (`test_at_the_edge_a_tick_over_the_trigger_now_and_then_adds_nothing`), and neither fires on a
  burst the fleet drains itself (`test_at_the_edge_a_trigger_waits_out_a_burst_the_fleet_drains`);
- panic (Knative): when the short window's demand asks for `panic_factor` x the ready replicas,
  scale to it at once, without the step limit, and scale in nothing until the stable window has
  passed without panic (`test_a_sudden_surge_panics_to_what_the_short_window_needs`);
- predictive: a forecaster (`policy.forecast`) of the arrival rate, asked for the rate one cold
  start ahead, turned into demand with the concurrency per arrival the pool shows (Little's law);
  capacity is then ready when the demand arrives instead of a cold start after it
  (`test_the_predictive_layer_scales_a_cold_start_ahead_of_the_forecast`).
Scale-in takes the highest desired count of the last `scale_down_window_s` (HPA's stabilisation
window), one step per stable window (`test_scale_in_waits_its_window_then_goes_a_step_per_stable_window`,
`test_the_fleet_found_at_start_is_not_cut_before_a_window`). On work demand, a noise band of
`noise_band_sigmas` (2) standard errors around the window's mean: the reactive count goes out only to
what the lower bound needs and in only to what the upper bound needs, so a need on a replica's
boundary neither flaps nor holds the replica above it
(`test_a_need_on_a_boundary_neither_flaps_nor_holds_the_replica_above`,
`test_a_noisy_flat_work_demand_never_scales_in`). With `edge_utilisation`, the latency feedback:
on work demand the pool runs at that utilisation while every tick's P99 TTFT has stayed under its
target for `edge_hold_s`, else at `target_utilisation`, so it scales in to the edge only while the
latency has margin and backs off at a miss
(`test_latency_with_margin_lets_one_replica_run_near_its_edge`, `test_a_scale_in_waits_for_latency_margin`,
`test_a_latency_miss_holds_the_floor_and_its_replica`), except a miss the fleet absorbed
(`test_a_burst_the_fleet_absorbs_holds_no_replica`); at the floor while the work rises, at the
edge again once it falls, the fall followed without the scale-down window
(`test_the_top_of_a_rise_and_the_fall_after_it_run_at_the_edge`,
`test_an_established_fall_is_followed_without_the_scale_down_window`); the fleet found is not cut to
the edge before its latency is seen (`test_the_fleet_found_is_not_cut_to_the_edge_before_its_latency_is_seen`);
at the edge a scale-in keeps what the busiest window of the last `edge_hold_s` needs unless the work
falls (`test_at_the_edge_a_scale_in_keeps_what_the_busiest_recent_minute_needs`).
The body drains a replica before it stops it: no request is aborted by a scale-in
(`tests/sim/test_scaling.py::test_the_pool_grows_for_a_surge_and_shrinks_by_draining_after_it`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Protocol

from tidegate.policy.forecast import Forecaster
from tidegate.policy.throughput import PoolSample, SaturatedThroughput

__all__ = ["AutoscaleSettings", "ScaleSignals", "ScaleLayer", "ScaleDecision", "ScalePolicy", "Autoscaler", "HpaRule",
           "FixedFleet"]


@dataclass(frozen=True, slots=True)
class AutoscaleSettings:
    slots_per_replica: int  # requests a replica holds at its latency target (the pool's slot limit)
    min_replicas: int = 1
    max_replicas: int = 8
    target_utilisation: float = 0.7
    stable_window_s: float = 60.0
    panic_window_s: float = 6.0
    panic_factor: float = 2.0
    scale_up_step: float = 0.25
    scale_down_window_s: float = 300.0
    queue_trigger: int = 100
    latency_trigger: float = 1.2
    cold_start_s: float = 60.0  # how far ahead the predictive layer looks
    forecast_bucket_s: float = 60.0  # the forecaster sees the arrival rate of buckets this long
    # tokens (prompt + output) per second one replica serves at its slot limit, at the pool's
    # request shape, measured (`sim.capacity.saturated_rps` x tokens per request, or a live run);
    # set, demand is the work arriving (`ScaleSignals.arrived_tokens`) rather than requests held
    replica_tokens_per_s: float | None = None
    # unset, the throughput is measured from the work served while the pool is saturated
    # (`policy.throughput`; the body must count `ScaleSignals.served_tokens`): the pool scales on
    # requests held until it has seen enough saturation, then on work
    measure_throughput: bool = True
    # on work demand, the reactive count moves only when the work's mean, give or take this many
    # standard errors, needs another: out to what the lower bound needs, in to what the upper
    # bound needs; within the band the fleet holds (`_work_band`). 0: off, the mean decides. 2 by
    # default: `bench/autoscale_sim.py` passes 11 bars with it, 10 on the mean (the surge's
    # replica-hours, 1.14x the oracle's against 1.17x), none failing that passed
    noise_band_sigmas: float = 2.0
    # on work demand, the utilisation the pool may run at while its latency has margin: every tick's
    # P99 TTFT (`ScaleSignals.ttft_ratio`) under its target for `edge_hold_s`; otherwise
    # `target_utilisation`, the floor (`_target`). None: always the floor. The working day's night
    # sits at 0.90-0.95 of one replica, which meets the SLO there (the oracle's 1 replica) and
    # which a fixed target low enough for the day's rising peak cannot hold (docs/autoscaling.md)
    edge_utilisation: float | None = None
    edge_hold_s: float = 300.0  # a latency miss holds the floor this long: the oscillation window

    def __post_init__(self) -> None:
        if self.slots_per_replica < 1 or not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need slots_per_replica >= 1 and 1 <= min_replicas <= max_replicas")
        if not 0 < self.target_utilisation <= 1 or self.scale_up_step <= 0 or self.panic_factor <= 1:
            raise ValueError("need target_utilisation in (0, 1], scale_up_step > 0, panic_factor > 1")
        if not 0 < self.panic_window_s <= self.stable_window_s or self.forecast_bucket_s <= 0:
            raise ValueError("need 0 < panic_window_s <= stable_window_s and forecast_bucket_s > 0")
        if self.replica_tokens_per_s is not None and self.replica_tokens_per_s <= 0:
            raise ValueError("replica_tokens_per_s must be > 0")
        if self.noise_band_sigmas < 0:
            raise ValueError("noise_band_sigmas must be >= 0")
        if self.edge_utilisation is not None and not self.target_utilisation <= self.edge_utilisation <= 1:
            raise ValueError("need target_utilisation <= edge_utilisation <= 1")
        if self.edge_hold_s < 0:
            raise ValueError("edge_hold_s must be >= 0")


@dataclass(frozen=True, slots=True)
class ScaleSignals:
    now_s: float
    ready: int  # replicas serving
    starting: int  # requested and not ready yet
    in_flight: int  # requests on the replicas
    queued: int  # requests waiting for a replica
    arrivals: int  # requests that arrived since the previous tick
    refused: int = 0  # of them (or of those queued before), refused: demand the fleet did not hold
    ttft_ratio: float | None = None  # recent P99 TTFT / its tier's target, the worst tier; None: unknown
    arrived_tokens: int = 0  # prompt + output tokens of the arrivals since the previous tick (refused ones too)
    served_tokens: int = 0  # prompt + output tokens of the requests answered since the previous tick


class ScaleLayer(Enum):
    HOLD = "hold"
    REACTIVE = "reactive"
    TRIGGER = "trigger"
    PANIC = "panic"
    PREDICTIVE = "predictive"
    BOUNDS = "bounds"  # min_replicas or max_replicas decided


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    desired: int
    layer: ScaleLayer
    reason: str  # the signal values behind it, for the log line and the event


class ScalePolicy(Protocol):
    def on_tick(self, signals: ScaleSignals) -> ScaleDecision:
        """Records the signals and decides the pool's size (changes state)."""
        ...


class FixedFleet:
    """Static provisioning (e.g. for twice the peak): the baseline every autoscaler must beat on cost."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas

    def on_tick(self, signals: ScaleSignals) -> ScaleDecision:
        return ScaleDecision(self.replicas, ScaleLayer.HOLD, "fixed")


# the share of the stable window's ticks whose P99 TTFT may reach its target before the window
# counts as a miss (`Autoscaler._latency_missed`)
MISSED_TICKS_SHARE = 0.1
# standard errors by which a window's work must exceed the window's `edge_hold_s` before to count
# as a rise (`Autoscaler._work_trend`). A minute apart, the surge's ramp adds 10 % to its 60
# requests a second, as much as 3 standard errors of the night's 24 a second, and at 3 the flat
# night of `test_latency_with_margin_lets_one_replica_run_near_its_edge` sat 10-27 % of the hour at
# two replicas on three seeds of six; 300 s apart the ramp adds 50 %, clear of 5
RISE_SIGMAS = 5.0
# standard errors by which a window's work must fall short of the window a stable window before to
# count as a fall, which ends a rise's hold on the floor (`Autoscaler._work_trend`). The working
# day's evening falls by a replica's worth a minute, 3-5 standard errors a window apart; a flat
# level crosses 3 by noise now and then, which only brings the edge early
FALL_SIGMAS = 3.0


@dataclass(slots=True)
class _Miss:
    """A latency miss going on (`Autoscaler._note_latency`)."""

    since_s: float  # the tick it was first judged a miss
    ready: int  # the replicas ready then
    last_slow_s: float  # the last tick at its target since
    recovered_ready: int | None = None  # the replicas ready at the first tick under target after it


class _Trend(NamedTuple):
    """The stable window's work against the windows before it (`Autoscaler._work_trend`)."""

    rising: bool  # over the window `edge_hold_s` before by `RISE_SIGMAS`, and not falling
    falling: bool  # under the window a stable window before by `FALL_SIGMAS`


class _Band(NamedTuple):
    """The noise band on work demand, in replicas."""

    lower: int  # what the window's mean minus k standard errors needs
    upper: int  # what its mean plus k standard errors needs
    low_share: float  # the lower bound over the mean (1 while the band is not measured yet)


class Autoscaler:
    def __init__(self, settings: AutoscaleSettings, forecaster: Forecaster | None = None) -> None:
        self.settings = settings
        self.forecaster = forecaster
        self._demand: deque[tuple[float, float]] = deque()  # (time, demand), the stable window
        self._arrivals: deque[tuple[float, int]] = deque()  # (time, arrivals), the stable window
        self._refused: deque[tuple[float, int]] = deque()  # (time, refusals), the stable window
        # (time, tokens arrived, requests arrived, seconds since the previous tick: 0 for the first)
        self._work: deque[tuple[float, int, int, float]] = deque()
        self._last_tick_s: float | None = None
        self._desired: deque[tuple[float, int]] = deque()  # (time, desired before scale-in damping)
        self._panic_until_s = -math.inf
        self._last_scale_in_s = -math.inf
        self._latency_missed_s = -math.inf  # the last tick the window missed its latency target
        self._rising_s = -math.inf  # the last tick the work rose (`_work_trend`); -inf once it falls
        self._miss: _Miss | None = None  # the latency miss going on (`_note_latency`)
        self._falling = False  # this tick's work falls (`_work_trend`)
        self._fell_s = -math.inf  # the last tick it fell
        self._window_work: deque[tuple[float, float, float]] = deque()  # (time, the window's rate, its standard error)
        self._over_target: deque[tuple[float, bool]] = deque()  # (time, P99 TTFT at its target), the window
        self._target = settings.target_utilisation  # this tick's utilisation target (`_target_at`)
        self._in_target = settings.target_utilisation  # the target a scale-in is counted at (`_scale_in_target`)
        self._first_tick_s: float | None = None
        self._last_ready: int | None = None  # the replicas ready at the previous tick
        self._ready_changed_s = -math.inf  # the last tick their count changed (the fleet found: settled)
        self._over_trigger: deque[tuple[float, bool]] = deque()  # (time, P99 at the trigger) since then, at the edge
        self._bucket_start_s: float | None = None
        self._bucket_arrivals = 0
        self._queued: deque[tuple[float, int]] = deque()  # (time, requests queued), the panic window
        self._queue_over_since_s: float | None = None  # the first tick of the queue's run at its trigger
        self._measured = SaturatedThroughput(settings.slots_per_replica) if (
            settings.replica_tokens_per_s is None and settings.measure_throughput) else None

    # ---- queries ------------------------------------------------------------------------------

    @property
    def replica_tokens_per_s(self) -> float | None:
        """One replica's token throughput at its slot limit: as set, else as measured (None: not
        known yet, or not measured; demand is then requests held)."""
        if self.settings.replica_tokens_per_s is not None:
            return self.settings.replica_tokens_per_s
        return None if self._measured is None else self._measured.tokens_per_s

    def _replicas_for(self, demand: float, target: float | None = None) -> int:
        return math.ceil(demand / (self.settings.slots_per_replica * (target or self._target)) - 1e-9)

    def _scale_in_target(self, now_s: float) -> float:
        """The utilisation a scale-in is counted at (changes state: notes the first tick seen):
        this tick's target, except that the pool does not cut the fleet it found to the edge
        before it has seen its latency for `edge_hold_s`: unseen latency is no margin (nor a miss, so a scale-out is counted at the
        edge meanwhile). The working day's pool, started with the 2 replicas its night needs at
        the floor, cut one at the edge 89 s in and asked for it back 83 s later when the one
        replica queued: its one flap (`test_the_fleet_found_is_not_cut_to_the_edge_before_its_latency_is_seen`)."""
        s = self.settings
        if self._first_tick_s is None:
            self._first_tick_s = now_s
        if s.edge_utilisation is None or now_s - self._first_tick_s >= s.edge_hold_s:
            return self._target
        return s.target_utilisation

    def _latency_missed(self, now_s: float, ttft_ratio: float | None) -> bool:
        """Whether more than `MISSED_TICKS_SHARE` of the stable window's ticks had their P99 TTFT at
        its target (changes state). One tick's P99 of a second's few dozen first tokens is their
        slowest: on the working day's night one replica at 0.92 met the SLO over each minute, yet a
        tick reached it every few minutes, and a miss on one tick sent the night back to two
        replicas: 2.44 replica-hours (1.28x the oracle's), 2.30 (1.21x) on a tenth, before
        `_work_trend` (docs/autoscaling.md)."""
        window_s = self.settings.stable_window_s
        self._over_target.append((now_s, (ttft_ratio or 0.0) >= 1.0))
        while self._over_target and self._over_target[0][0] <= now_s - window_s:
            self._over_target.popleft()
        if now_s - self._over_target[0][0] < window_s / 2:  # a few ticks' share says little, as for the band
            return False
        return sum(over for _, over in self._over_target) > MISSED_TICKS_SHARE * len(self._over_target)

    def _note_latency(self, now_s: float, ready: int, ttft_ratio: float | None) -> None:
        """Records this tick's latency; a miss holds the floor for `edge_hold_s` after it, unless
        the fleet that missed absorbed it: its latency came back under the target with no more
        replicas ready than at the miss, within a cold start of it, so no replica the miss asked
        for restored it, and the replica the hold would keep is not needed (changes state). On the
        working day's night one replica at 0.90-0.96 of its throughput queues for 10-15 s every
        half hour or so and drains the queue itself; the replica asked for was ready 50 s after,
        and the hold kept it 300 s more: 0.18 replica-hours over the oracle's, a tenth of its day
        (`test_a_burst_the_fleet_absorbs_holds_no_replica`)."""
        missed, slow = self._latency_missed(now_s, ttft_ratio), (ttft_ratio or 0.0) >= 1.0
        miss = self._miss
        if missed:
            self._latency_missed_s = now_s
            if miss is None:
                miss = self._miss = _Miss(now_s, ready, now_s)
            if slow:
                miss.last_slow_s, miss.recovered_ready = now_s, None
            elif miss.recovered_ready is None:
                miss.recovered_ready = ready
        elif miss is not None:
            recovered_ready = ready if miss.recovered_ready is None else miss.recovered_ready
            if recovered_ready <= miss.ready and miss.last_slow_s - miss.since_s < self.settings.cold_start_s:
                self._latency_missed_s = -math.inf  # absorbed: no hold
            self._miss = None

    def _at_the_edge(self) -> bool:
        return self.settings.edge_utilisation is not None and self.replica_tokens_per_s is not None

    def _queue_draining(self, queued: int) -> bool:
        """Whether the queue is under its peak of the last panic window: the fleet is clearing it."""
        return queued < max(q for _, q in self._queued)

    def _latency_triggered(self, now_s: float, signals: ScaleSignals) -> bool:
        """Whether the latency trigger fires (changes state): a tick's P99 TTFT at `latency_trigger`
        x its target; at the edge, more than `MISSED_TICKS_SHARE` of the ticks since the ready count
        last changed, half a window of them seen, as the edge's miss is judged, and only while this
        tick is over it and the queue is not draining. The edge runs where a tick's slowest first
        token nears its target, and on the Azure trace the trigger fired on single ticks of its
        sub-minute bursts, asked for a quarter more replicas than the work needed, and the reactive
        count cut them a scale-down window later, often still starting: 6 flaps, 2 at the floor
        (`test_at_the_edge_a_tick_over_the_trigger_now_and_then_adds_nothing`). On a tenth it still
        fired on bursts the fleet had drained (13 s after the latency came back, at 3,259 s; a replica
        asked for then serves a cold start after the burst): a flap each
        (`test_at_the_edge_a_trigger_waits_out_a_burst_the_fleet_drains`)."""
        s, ttft_ratio = self.settings, signals.ttft_ratio
        over = (ttft_ratio or 0.0) >= s.latency_trigger
        if not self._at_the_edge():
            return over
        self._over_trigger.append((now_s, over))
        while self._over_trigger and (self._over_trigger[0][0] <= now_s - s.stable_window_s
                                      or self._over_trigger[0][0] < self._ready_changed_s):
            self._over_trigger.popleft()
        if not self._over_trigger or now_s - self._over_trigger[0][0] < s.stable_window_s / 2:
            return False
        share_over = sum(o for _, o in self._over_trigger) > MISSED_TICKS_SHARE * len(self._over_trigger)
        return share_over and over and not self._queue_draining(signals.queued)

    def _queue_triggered(self, now_s: float, queued: int) -> bool:
        """Whether the queue trigger fires: `queue_trigger` requests queued; at the edge, on every
        tick of the last panic window (a queue that stands, not a burst's peak). On the Azure trace at
        the edge the trigger fired on one tick's 117 and 102 queued of 10-15 s bursts that the fleet
        drained 5 s later by itself; the replicas asked for served a cold start after the burst had
        gone, and the two scale-ins before them counted as flaps
        (`test_at_the_edge_a_trigger_waits_out_a_burst_the_fleet_drains`)."""
        s = self.settings
        if not self._at_the_edge():
            return queued >= s.queue_trigger
        if queued < s.queue_trigger:
            self._queue_over_since_s = None
            return False
        if self._queue_over_since_s is None:
            self._queue_over_since_s = now_s
        return now_s - self._queue_over_since_s >= s.panic_window_s

    def _work_trend(self, now_s: float) -> _Trend:
        """Whether the stable window's work rises: exceeds the window's `edge_hold_s` before by more
        than `RISE_SIGMAS` standard errors of their difference, and falls: is short of the window a
        stable window before by more than `FALL_SIGMAS` (changes state). A rise is met at the
        floor: latency reaches its target only once the fleet is short, a cold start before the
        replica that restores it, and on the surge's ramp at the edge the P99 was 3,230 ms
        (`test_a_rise_in_work_is_met_at_the_floor`). A fall is no rise, however far the work still
        is over the level `edge_hold_s` before: read against that level alone, the working day's
        top and the first minutes of its fall rose, and with the hold after it the evening fell at
        the floor, 0.19 replica-hours over the oracle's
        (`test_the_top_of_a_rise_and_the_fall_after_it_run_at_the_edge`)."""
        s = self.settings
        if s.edge_utilisation is None or self.replica_tokens_per_s is None:
            return _Trend(False, False)
        since_s = now_s - s.stable_window_s
        ticks = [n / c for t, n, _, c in self._work if t > since_s and c > 0]
        if len(ticks) < 2 or sum(c for t, _, _, c in self._work if t > since_s) < s.stable_window_s / 2:
            return _Trend(False, False)
        mean = sum(ticks) / len(ticks)
        error = math.sqrt(sum((r - mean) ** 2 for r in ticks) / (len(ticks) - 1) / len(ticks))
        self._window_work.append((now_s, mean, error))
        lag_s = max(s.edge_hold_s, s.stable_window_s)
        while self._window_work[0][0] < now_s - lag_s:
            self._window_work.popleft()
        if now_s - self._window_work[0][0] < s.stable_window_s - 1e-9:  # under a window apart, they overlap
            return _Trend(False, False)
        # the window a stable window before: the newest at least a window old
        _, previous, previous_error = next(w for w in reversed(self._window_work)
                                           if w[0] <= now_s - s.stable_window_s + 1e-9)
        falling = previous - mean > FALL_SIGMAS * math.sqrt(error ** 2 + previous_error ** 2)
        if falling:
            self._fell_s = now_s
        # a rise is measured from the last fall, not across it: against the level `edge_hold_s`
        # before, the first minutes of a fall still rose whenever a tick's fall was under
        # `FALL_SIGMAS`, and the working day's top went 8, 7, 8, 7 replicas
        # (`test_an_established_fall_is_followed_without_the_scale_down_window`)
        then_s, before, before_error = next(w for w in self._window_work if w[0] >= self._fell_s)
        rising = (not falling and now_s - then_s >= s.stable_window_s - 1e-9
                  and mean - before > RISE_SIGMAS * math.sqrt(error ** 2 + before_error ** 2))
        return _Trend(rising, falling)

    def _recent_need(self) -> int | None:
        """At the edge on work demand, the replicas the busiest stable window of the last
        `edge_hold_s` needs at the scale-in's utilisation (None elsewhere): a scale-in goes no lower
        while the work is not falling. The band sizes a scale-in by this minute's mean, and the
        Azure trace's minutes wander by a replica's worth within a few (4.9, 5.3, 4.9, 3.9, 4.1, 3.9,
        4.0, 4.8, 5.0 replicas): cut to 5 at 948 s on a quiet minute, the pool met a burst of 7
        replicas' work 160 s later and asked for 7 again, a flap; the oracle's need rose back to 6
        there. An established fall (`_work_trend`) is followed without it, as without the window
        (the working day's evening) (`test_at_the_edge_a_scale_in_keeps_what_the_busiest_recent_minute_needs`)."""
        if not self._at_the_edge() or not self._window_work:
            return None
        busiest = max(mean for _, mean, _ in self._window_work)
        return self._replicas_for(busiest / self.replica_tokens_per_s * self.settings.slots_per_replica,
                                  self._in_target)

    def _target_at(self, now_s: float) -> float:
        """The utilisation the pool runs at: the edge while its latency has margin (on work demand
        only: requests held read full slots whatever the work), else the floor. Only a pool that
        checks its latency can run near a replica's edge: on the working day a fixed 0.95 missed
        the P99 on the rising peak, and 0.85 kept two replicas all night where one meets the SLO.
        The floor holds for `edge_hold_s` after a miss, so the replica a miss added is not taken
        away by the latency it restored (`test_a_latency_miss_holds_the_floor_and_its_replica`),
        and after a rise (`_work_trend`) until the work falls."""
        s = self.settings
        if s.edge_utilisation is None or self.replica_tokens_per_s is None:
            return s.target_utilisation
        held_since_s = max(self._latency_missed_s, self._rising_s)
        return s.target_utilisation if now_s - held_since_s < s.edge_hold_s else s.edge_utilisation

    @staticmethod
    def _mean(samples: deque, since_s: float) -> float:
        values = [value for t, value in samples if t > since_s]
        return sum(values) / len(values) if values else 0.0

    def _demand_since(self, since_s: float) -> float:
        """Requests the pool must hold at once, from the work arriving when replica_tokens_per_s is
        set, else from the requests it holds."""
        if self.replica_tokens_per_s is not None:
            return self._work_demand_since(since_s)
        return self._held_demand_since(since_s)

    def _work_rate_since(self, since_s: float) -> float:
        """Tokens arrived per second since then (the first tick's tokens cover an unknown time: left out)."""
        tokens = sum(n for t, n, _, c in self._work if t > since_s and c > 0)
        covered_s = sum(c for t, _, _, c in self._work if t > since_s)
        return tokens / covered_s if covered_s > 0 else 0.0

    def _work_demand_since(self, since_s: float) -> float:
        """The work arriving since then in slots' worth: tokens per second over what one replica
        serves at its slot limit, times its slots. Unlike requests held, it does not grow as the
        replicas near saturation (each request then takes longer, so more are held for the same
        work): counted in requests held, the working day's peak asked for 1.3x the oracle's
        replica-hours at 71 % utilisation (`bench/autoscale_sim.py`, docs/autoscaling.md)."""
        tokens_per_s = self.replica_tokens_per_s
        assert tokens_per_s is not None
        return self._work_rate_since(since_s) / tokens_per_s * self.settings.slots_per_replica

    def _work_band(self, since_s: float, fleet: int) -> _Band | None:
        """The replicas the work since then needs at its mean minus and plus `noise_band_sigmas`
        standard errors (of the per-tick rates' mean); None when the band is off or demand is
        requests held; the fleet while under half a window of work says how noisy it is. The mean
        of a window of Poisson-like arrivals wanders by its standard error, so a need sitting near
        a replica's boundary crosses it by noise alone. Scaling in only past the upper bound, a
        fleet on such a level does not read a dip as a fall
        (`test_a_noisy_flat_work_demand_never_scales_in`); scaling out only past the lower bound, a
        noisy minute does not add the replica the scale-in band would then hold
        (`test_a_need_on_a_boundary_neither_flaps_nor_holds_the_replica_above`). A real change
        clears the band (`test_a_real_fall_in_work_scales_in_after_the_window`,
        `test_a_real_rise_in_work_clears_the_band_within_a_window`)."""
        s, tokens_per_s = self.settings, self.replica_tokens_per_s
        if tokens_per_s is None or s.noise_band_sigmas <= 0:
            return None
        ticks = [(n, c) for t, n, _, c in self._work if t > since_s and c > 0]
        # two or three ticks' spread says little: their band once asked for a 7th replica on a need
        # of 5.9 two seconds in (`test_the_band_waits_for_half_a_window_of_work`)
        if len(ticks) < 2 or sum(c for _, c in ticks) < s.stable_window_s / 2:
            return _Band(fleet, fleet, 1.0)
        rates = [n / c for n, c in ticks]
        mean = sum(rates) / len(rates)
        variance = sum((r - mean) ** 2 for r in rates) / (len(rates) - 1)
        half = s.noise_band_sigmas * math.sqrt(variance / len(rates))
        rate = self._work_rate_since(since_s)
        per_slot = s.slots_per_replica / tokens_per_s
        lower = max(0.0, rate - half)
        upper = self._replicas_for((rate + half) * per_slot, self._in_target)  # the fleet found: `_scale_in_target`
        return _Band(self._replicas_for(lower * per_slot), upper,
                     lower / rate if rate > 0 else 1.0)

    def _held_demand_since(self, since_s: float) -> float:
        """Mean requests held since then, scaled up by the share of arrivals refused: under early
        refusal the queue stays short and the replicas' slots full whatever the load, so the
        refused arrivals are demand the fleet would have held (at the latency it shows now).
        Without them, a pool refusing 90 % of a 2x load read as needing the one replica it had."""
        arrived = sum(a for t, a in self._arrivals if t > since_s)
        refused = sum(r for t, r in self._refused if t > since_s)
        factor = arrived / max(arrived - refused, 1) if refused else 1.0
        return self._mean(self._demand, since_s) * factor

    def _predicted(self, now_s: float, low_share: float = 1.0) -> int | None:
        """Replicas the forecast demand one cold start ahead needs, at `low_share` of it (the noise
        band's lower bound: a forecast from the last minute's rate carries that minute's noise, and
        without the band it added the replica above a need of 5.9 that the band then held, 59-82 %
        of an hour at 7: `test_a_forecast_on_a_boundary_is_held_to_the_band_too`); None without a
        forecast."""
        if self.forecaster is None:
            return None
        s = self.settings
        rate = self.forecaster.forecast(now_s + s.cold_start_s + s.forecast_bucket_s)
        arrived = sum(a for _, _, a, covered_s in self._work if covered_s > 0)
        covered = sum(covered_s for _, _, _, covered_s in self._work)
        arrivals_per_s = arrived / covered if covered > 0 else 0.0
        if rate is None or arrivals_per_s <= 0:
            return None
        # the demand one arrival makes (work, or requests held by Little's law) times the rate forecast
        held_per_arrival_s = self._demand_since(now_s - s.stable_window_s) / arrivals_per_s
        return self._replicas_for(rate * held_per_arrival_s * low_share)

    # ---- the event ----------------------------------------------------------------------------

    def on_tick(self, signals: ScaleSignals) -> ScaleDecision:
        """Records the signals and decides the pool's size (changes state)."""
        s, now_s = self.settings, signals.now_s
        demand = float(signals.in_flight + signals.queued)
        if self._measured is not None:
            self._measured.observe(PoolSample(now_s, signals.ready, signals.in_flight, signals.queued,
                                              signals.served_tokens))
        self._record(now_s, demand, signals.arrivals, signals.refused, signals.arrived_tokens)
        self._note_latency(now_s, signals.ready, signals.ttft_ratio)
        trend = self._work_trend(now_s)
        if trend.rising:
            self._rising_s = now_s
        elif trend.falling:
            self._rising_s = -math.inf
        self._falling = trend.falling
        self._target = self._target_at(now_s)
        self._in_target = self._scale_in_target(now_s)
        fleet = signals.ready + signals.starting
        stable_demand = self._demand_since(now_s - s.stable_window_s)
        panic_demand = self._demand_since(now_s - s.panic_window_s)
        stable, panic = self._replicas_for(stable_demand), self._replicas_for(panic_demand)
        band = self._work_band(now_s - s.stable_window_s, fleet)
        if band is None:
            reactive = max(stable, min(fleet, self._replicas_for(stable_demand, self._in_target)))
        else:
            reactive = min(max(fleet, band.lower), band.upper)
        low_share = 1.0 if band is None else band.low_share
        step_cap = max(fleet + 1, math.ceil(fleet * (1 + s.scale_up_step)))
        candidates = [(min(reactive, step_cap), ScaleLayer.REACTIVE,
                       f"mean demand {stable_demand:.1f} over {s.stable_window_s:g} s at {self._target:.0%}"
                       + ("" if band is None else f", band {band.lower}..{band.upper} replicas"))]
        # the demand itself against the factor, not its count rounded up: at one replica a count
        # of 2 is any demand over one replica's, and the working day's night, one replica at
        # 0.90-0.95 of it, panicked to two every few minutes (`test_one_replica_near_its_edge_does_not_panic`)
        if signals.ready and panic_demand >= s.panic_factor * signals.ready * s.slots_per_replica * self._target:
            self._panic_until_s = now_s + s.stable_window_s
        panicking = now_s < self._panic_until_s
        if panicking:
            candidates.append((max(panic, fleet), ScaleLayer.PANIC,
                               f"demand {panic_demand:.1f} over {s.panic_window_s:g} s, {signals.ready} ready"))
        # a trigger adds a step over the fleet: only once the previous step's replicas are up, or it
        # fires every tick of their cold start and the fleet compounds to the maximum; and a panic
        # window after they come up, or it reads the first tokens of requests that queued for them:
        # on the surge at the edge, the tick a third replica came up the trigger asked for a fourth
        # on a P99 2.61x its target, the backlog gone 2 s later, and the fourth was cut a window
        # after and asked for again: a flap (`test_a_trigger_waits_for_the_replicas_it_got_to_serve`)
        if self._last_ready is not None and signals.ready != self._last_ready:
            self._ready_changed_s = now_s
        self._last_ready = signals.ready
        settled = now_s - self._ready_changed_s >= s.panic_window_s
        self._queued.append((now_s, signals.queued))
        while self._queued[0][0] <= now_s - s.panic_window_s:
            self._queued.popleft()
        latency_triggered = self._latency_triggered(now_s, signals)  # every tick: it keeps a record
        queue_triggered = self._queue_triggered(now_s, signals.queued)
        triggered = queue_triggered or latency_triggered
        if triggered and not signals.starting and settled:
            candidates.append((step_cap, ScaleLayer.TRIGGER,
                               f"queued {signals.queued}, TTFT P99 {signals.ttft_ratio or 0:.2f}x target"))
        predicted = self._predicted(now_s, low_share)
        if predicted is not None:
            candidates.append((predicted, ScaleLayer.PREDICTIVE, f"forecast {s.cold_start_s:g} s ahead"))
        desired, layer, reason = max(candidates, key=lambda c: c[0])
        if not self._desired:  # the fleet found at the start counts as asked for: no scale-in before a window
            self._desired.append((now_s, fleet))
        # within the scale-down window, never below what the upper bound asked for: a fall must
        # clear the band for the whole window, not one tick of it
        self._desired.append((now_s, desired if band is None else max(desired, band.upper)))
        while self._desired and self._desired[0][0] <= now_s - s.scale_down_window_s:
            self._desired.popleft()
        if desired < fleet:
            desired, layer, reason = self._scale_in(now_s, fleet, desired, panicking, layer, reason)
        elif desired > fleet:
            self._last_scale_in_s = -math.inf
        bounded = min(s.max_replicas, max(s.min_replicas, desired))
        if bounded != desired:
            return ScaleDecision(bounded, ScaleLayer.BOUNDS, f"{layer.value} asked {desired}; {reason}")
        return ScaleDecision(desired, layer, reason)

    def _scale_in(self, now_s: float, fleet: int, desired: int, panicking: bool, layer: ScaleLayer,
                  reason: str) -> tuple[int, ScaleLayer, str]:
        """To the highest count asked for over the scale-down window, and by one step (a
        `scale_up_step` of the fleet, at least one replica) per stable window: demand measured in
        requests held falls as replicas are added (each request finishes sooner), so a fleet
        grown for a burst reads as needing one replica; cut at once, it was overloaded the next
        minute and grew back to the maximum (the surge scenario, four times in 25 minutes). Work
        demand does not fall as replicas are added, so on it the fleet follows the damped count
        down as it falls, neither stepped nor held a stable window between cuts: stepping down a
        quarter a minute, the working day's evening paid 7 and 5 replicas where the oracle's 4
        and 2 served (`test_on_work_demand_a_scale_in_is_not_stepped`)."""
        s = self.settings
        # the window makes a fall clear the noise band for a whole window, not one tick; a fall
        # the trend has established (`_work_trend`) has cleared it, and held a window more it
        # lagged the working day's evening by a window: 0.12 replica-hours over the oracle's
        # (`test_an_established_fall_is_followed_without_the_scale_down_window`)
        damped = self._desired[-1][1] if self._falling else max(d for _, d in self._desired)
        if panicking or damped >= fleet:
            return fleet, ScaleLayer.HOLD, ("panicking" if panicking
                                            else f"asked {desired}, {damped} within {s.scale_down_window_s:g} s")
        recent = self._recent_need()
        if recent is not None and not self._falling:
            if recent >= fleet:
                return fleet, ScaleLayer.HOLD, (f"asked {desired}; the busiest window of the last "
                                                f"{s.edge_hold_s:g} s needs {recent}")
            damped = max(damped, recent)
        if self.replica_tokens_per_s is not None:
            return damped, layer, reason
        if now_s - self._last_scale_in_s < s.stable_window_s:
            return fleet, ScaleLayer.HOLD, f"asked {desired}; the last scale-in is under {s.stable_window_s:g} s old"
        self._last_scale_in_s = now_s
        step = max(1, math.floor(fleet * s.scale_up_step))
        return max(damped, fleet - step), layer, reason

    def _record(self, now_s: float, demand: float, arrivals: int, refused: int, tokens: int) -> None:
        s = self.settings
        covered_s = 0.0 if self._last_tick_s is None else now_s - self._last_tick_s
        self._last_tick_s = now_s
        self._work.append((now_s, tokens, arrivals, covered_s))
        while self._work and self._work[0][0] <= now_s - s.stable_window_s:
            self._work.popleft()
        self._demand.append((now_s, demand))
        self._arrivals.append((now_s, arrivals))
        self._refused.append((now_s, refused))
        for samples in (self._demand, self._arrivals, self._refused):
            while samples and samples[0][0] <= now_s - s.stable_window_s:
                samples.popleft()
        if self.forecaster is None:
            return
        if self._bucket_start_s is None:
            self._bucket_start_s = now_s
        self._bucket_arrivals += arrivals
        if now_s - self._bucket_start_s >= s.forecast_bucket_s:
            self.forecaster.observe(now_s, self._bucket_arrivals / (now_s - self._bucket_start_s))
            self._bucket_start_s, self._bucket_arrivals = now_s, 0


class HpaRule:
    """Kubernetes' Horizontal Pod Autoscaler with its defaults, on the same demand signal, for
    comparison: every `sync_s`, desired = ceil(fleet x utilisation / target) unless within 10 %
    of the target; scale-in to the highest desired of the last 300 s."""

    def __init__(self, settings: AutoscaleSettings, *, sync_s: float = 15.0, tolerance: float = 0.1,
                 scale_down_window_s: float = 300.0) -> None:
        self.settings = settings
        self.sync_s, self.tolerance, self.scale_down_window_s = sync_s, tolerance, scale_down_window_s
        self._last_sync_s = -math.inf
        self._desired: deque[tuple[float, int]] = deque()
        self._current: int | None = None

    def on_tick(self, signals: ScaleSignals) -> ScaleDecision:
        """Decides at each sync and holds between them (changes state)."""
        s, now_s = self.settings, signals.now_s
        fleet = signals.ready + signals.starting
        if self._current is None:
            self._current = fleet
        if now_s - self._last_sync_s < self.sync_s:
            return ScaleDecision(self._current, ScaleLayer.HOLD, "between syncs")
        self._last_sync_s = now_s
        ready = max(signals.ready, 1)
        ratio = (signals.in_flight + signals.queued) / (ready * s.slots_per_replica) / s.target_utilisation
        desired = fleet if abs(ratio - 1.0) <= self.tolerance else math.ceil(ready * ratio - 1e-9)
        if not self._desired:  # the fleet found at the start counts as asked for
            self._desired.append((now_s, fleet))
        self._desired.append((now_s, desired))
        while self._desired and self._desired[0][0] <= now_s - self.scale_down_window_s:
            self._desired.popleft()
        if desired < fleet:
            desired = min(fleet, max(d for _, d in self._desired))
        self._current = min(s.max_replicas, max(s.min_replicas, desired))
        return ScaleDecision(self._current, ScaleLayer.REACTIVE, f"utilisation / target {ratio:.2f}")
