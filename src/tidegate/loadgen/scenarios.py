"""Named scenarios for `tidegate bench --scenario NAME`. PURE: they only build traffic streams.

surge: the showcase. Protected tiers (critical, standard) keep a steady Poisson rate while the
sheddable tier surges to `factor` x its baseline for a window in the middle of the run. Against a
`tidegate serve` with overload control, premium TTFT should hold while sheddable traffic gets fast
429s and degraded replies; without it, everyone's TTFT grows. The report says which happened.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidegate.loadgen.arrivals import Poisson, Surge
from tidegate.loadgen.mix import LengthDistribution, Tenant
from tidegate.loadgen.plan import TrafficStream

__all__ = ["SurgeScenario", "SURGE_DEFAULT_TENANTS", "SCENARIOS"]

SURGE_DEFAULT_TENANTS = (
    Tenant(name="premium", api_key="sk-premium", tier="critical", share=1.0),
    Tenant(name="free", api_key="sk-free", tier="sheddable", share=1.0),
)
SCENARIOS = ("surge",)


@dataclass(frozen=True)
class SurgeScenario:
    protected_rps: float = 2.0  # steady rate shared by non-sheddable tenants
    sheddable_rps: float = 4.0  # sheddable baseline; `factor` x this during the surge
    factor: float = 3.0
    duration_s: float = 60.0
    surge_start_fraction: float = 1 / 3  # the surge covers the middle third of the run
    surge_length_fraction: float = 1 / 3

    @property
    def surge_window_s(self) -> tuple[float, float]:
        start = self.duration_s * self.surge_start_fraction
        return start, start + self.duration_s * self.surge_length_fraction

    def phases(self) -> list[tuple[str, float, float]]:
        """(name, start_s, end_s) by send time, for the before / during / after report."""
        start, end = self.surge_window_s
        return [("before", 0.0, start), ("surge", start, end), ("after", end, self.duration_s)]

    def streams(self, tenants: tuple[Tenant, ...], prompt_tokens: LengthDistribution,
                max_tokens: LengthDistribution) -> list[TrafficStream]:
        sheddable = tuple(t for t in tenants if t.tier == "sheddable")
        protected = tuple(t for t in tenants if t.tier != "sheddable")
        if not sheddable or not protected:
            raise ValueError("the surge scenario needs at least one sheddable and one other tenant")
        start, end = self.surge_window_s
        surge = Surge(base_rps=self.sheddable_rps, factor=self.factor, start_s=start, length_s=end - start)
        return [
            TrafficStream(Poisson(self.protected_rps), protected, prompt_tokens, max_tokens),
            TrafficStream(surge, sheddable, prompt_tokens, max_tokens),
        ]
