"""Rule 5's headroom sized to the better levels' demand against fixed shares of the engine, on the
`critical_burst` and `noisy_tenant` bars: protected P99 over unloaded (worst, mean, per seed) and
requests within target over the whole runs against FIFO's, with the paired noise the scenarios'
verdicts use.

    python bench/headroom_demand.py [--scenario critical_burst|noisy_tenant] [--only A,B] [--seeds 31,41]

The variants drive the same controller; only rule 5's headroom differs:
- "controller": as it is (`policy.pool`, sized each tick to the better requests sent per request
  ended, plus a floor); "controller: ...": the same with its constants set otherwise (ablations);
- "fixed H": 48 - H slots a level and better, H only better levels may take, never sized (the
  controller before the sizing: "fixed 16");
- exploratory sizings of the worse level's cap (`DemandHeadroom`): "peak" (the better levels' recent
  peak in flight x a margin + extra), "unused" (that, less the better requests holding a slot now),
  "rate" (the sizing the controller kept, computed outside it: x margin + extra slots).
The scenarios' own seeds by default; `--seeds` for more: P99 ratios of a few seeds move by
+-0.05 between equivalent implementations, and a rare seed holds a verdict flap (see
docs/overload-knobs.md).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping

import numpy as np
from protection_levers import SCENARIOS, window_p99

from tidegate.policy import pool
from tidegate.policy.pool import PoolController, PoolReplica, PoolSettings
from tidegate.policy.shares import TenantShares
from tidegate.sim import scenarios as S
from tidegate.sim.scenarios import PairedGood
from tidegate.types import Dispatch, ReplicaLoad

ENGINE = S.CEILING + S.HEADROOM
# the level rule 5 caps in each scenario (sheddable; the flood, standard demoted): the better levels
# are those above it
WORSE_LEVEL = {"critical_burst": 4, "noisy_tenant": 3}
SIZING_PERIOD_S = 0.05  # how often the headroom is sized: a tick, not a request


class FixedHeadroom(PoolController):
    """The controller with rule 5's headroom as configured, never sized to demand."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._headroom_sized_s = math.inf  # the controller's tick never finds it due


class DemandHeadroom(FixedHeadroom):
    """The controller, its replicas' headroom sized each tick to the better levels' recent demand,
    at most the configured headroom:
    - "peak": margin x the better levels' peak in flight on the replica (decaying with `half_life_s`)
      + extra, kept free beside what they hold (the headroom is that many slots);
    - "unused": that, less the better requests holding a slot now (the slots they are likely to want
      and do not hold yet);
    - "rate": margin x the better requests the replica is sent while one of its slots frees (their
      rate over its rate of finishes, both decaying with `half_life_s`) + extra."""

    def __init__(self, replicas, tiers, settings, *, shares, worse_level: int, mode: str, margin: float,
                 extra: int, half_life_s: float) -> None:
        super().__init__(replicas, tiers, settings, shares=shares)
        self.worse_level, self.mode, self.margin, self.extra, self.half_life_s = (worse_level, mode, margin, extra,
                                                                                  half_life_s)
        self.sized_s = -math.inf
        self.peaks = {r.config.replica_id: 0.0 for r in self._order}
        self.better_sent = {r.config.replica_id: 0.0 for r in self._order}  # decaying counts
        self.finished = {r.config.replica_id: 0.0 for r in self._order}

    def on_capacity(self, now_s: float, loads: Mapping[str, ReplicaLoad] = {}) -> Dispatch:
        if now_s - self.sized_s >= SIZING_PERIOD_S:
            self.size(now_s)
        return super().on_capacity(now_s, loads)

    def _try_assign(self, now_s, request, exclude, *args, **kwargs):
        assignment = super()._try_assign(now_s, request, exclude, *args, **kwargs)
        if assignment is not None and assignment.priority < self.worse_level:
            self.better_sent[assignment.replica_id] += 1
        return assignment

    def _end(self, request_id):
        sent = super()._end(request_id)
        if sent is not None:
            self.finished[sent.replica_id] += 1
        return sent

    def size(self, now_s: float) -> None:
        elapsed = now_s - self.sized_s if self.sized_s > -math.inf else 0.0
        decay = 0.5 ** (elapsed / self.half_life_s)
        self.sized_s = now_s
        for replica in self._order:
            rid = replica.config.replica_id
            better = sum(replica.held[: self.worse_level])
            peak = self.peaks[rid] = max(better, better + (self.peaks[rid] - better) * decay)
            if self.mode == "rate":
                sent, finished = self.better_sent[rid], self.finished[rid]
                want = math.ceil(self.margin * sent / finished) + self.extra if sent and finished else 0
                self.better_sent[rid], self.finished[rid] = sent * decay, finished * decay
            else:
                want = math.ceil(self.margin * peak) + self.extra if peak > 0 else 0
                if self.mode == "unused":
                    want = max(0, want - better)
            replica.caps = [replica.slots() - min(replica.config.headroom, want)] * len(replica.caps)


def fixed(headroom: int) -> Callable[[str], S.Kind]:
    return lambda scenario: lambda ids, tiers: FixedHeadroom(
        [PoolReplica(i, ENGINE - headroom, headroom) for i in ids], tiers, PoolSettings(), shares=TenantShares())


def demand(mode: str, margin: float, extra: int, half_life_s: float = 5.0) -> Callable[[str], S.Kind]:
    return lambda scenario: lambda ids, tiers: DemandHeadroom(
        [PoolReplica(i, S.CEILING, S.HEADROOM) for i in ids], tiers, PoolSettings(), shares=TenantShares(),
        worse_level=WORSE_LEVEL[scenario], mode=mode, margin=margin, extra=extra, half_life_s=half_life_s)


# the controller as it is, with its sizing's constants set otherwise (for the runs of that variant)
SIZINGS: dict[str, dict[str, float]] = {
    "controller": {},
    "controller: no floor": {"HEADROOM_FLOOR_SHARE": 0.0},
    "controller: floor only": {"HEADROOM_ARRIVALS": 0.0},
    "controller: floor 1/2": {"HEADROOM_FLOOR_SHARE": 0.5},
    "controller: arrivals x4": {"HEADROOM_ARRIVALS": 4.0},
    "controller: arrivals x8": {"HEADROOM_ARRIVALS": 8.0},
}

VARIANTS: dict[str, Callable[[str], S.Kind]] = {
    **{name: (lambda scenario: S.controller) for name in SIZINGS},
    "fixed 16 (today)": fixed(16),
    "fixed 14": fixed(14),
    "fixed 12": fixed(12),
    "fixed 10": fixed(10),
    "fixed 8": fixed(8),
    "peak x1 +1": demand("peak", 1.0, 1),
    "peak x1.5 +2": demand("peak", 1.5, 2),
    "unused x1 +2": demand("unused", 1.0, 2),
    "unused x1.5 +2": demand("unused", 1.5, 2),
    "unused x2 +2": demand("unused", 2.0, 2),
    "rate x1 +1": demand("rate", 1.0, 1),
    "rate x2 +2": demand("rate", 2.0, 2),
    "rate x4 +4": demand("rate", 4.0, 4),
    "rate x3 +3": demand("rate", 3.0, 3),
    "rate x4 +6": demand("rate", 4.0, 6),
    "rate x6 +6": demand("rate", 6.0, 6),
    "rate x6 +8": demand("rate", 6.0, 8),
    "rate x8 +6": demand("rate", 8.0, 6),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="critical_burst")
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--seeds", default="", help="comma-separated seeds (default: the scenario's)")
    args = parser.parse_args()
    make, seeds = SCENARIOS[args.scenario]
    seeds = [int(x) for x in args.seeds.split(",") if x] or seeds
    cap = S.capacity_rps(S.REPLICAS)
    cases = []
    for seed in seeds:
        requests, alone_requests, about, window, bar = make(seed, cap)
        unloaded = window_p99(S.controller, alone_requests, about, window)
        cases.append((requests, about, window, unloaded, S.run(S.fifo, S.REPLICAS, requests, probes_s=window)))
    print(f"{args.scenario}: bar {bar}x over {len(seeds)} seeds")
    wanted = [v for v in args.only.split(",") if v] or list(VARIANTS)
    for label in wanted:
        ratios, pairs = [], []
        constants = SIZINGS.get(label, {})
        saved = {name: getattr(pool, name) for name in constants}
        for name, value in constants.items():
            setattr(pool, name, value)
        for requests, about, window, unloaded, ref in cases:
            run_ = S.run(VARIANTS[label](args.scenario), S.REPLICAS, requests, probes_s=window)
            ratios.append(run_.p99_ttft_s([r for r in run_.records(None, *window) if about(r)]) / unloaded)
            pairs.append((run_, ref))
        for name, value in saved.items():
            setattr(pool, name, value)
        paired = PairedGood.of(pairs)
        print(f"{label:<22} worst {max(ratios):.2f}x mean {np.mean(ratios):.2f}x "
              f"({' '.join(f'{r:.2f}' for r in ratios)}); within target {paired.good} "
              f"({paired.good - paired.fifo_good:+d} vs FIFO {paired.fifo_good}, noise +-{paired.noise:.0f}); "
              f"busy >= {min(r.busy(*c[2]) for (r, _), c in zip(pairs, cases)):.1%}", flush=True)


if __name__ == "__main__":
    main()
