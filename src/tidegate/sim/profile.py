"""A replica profile: what the simulator needs to know of one engine on one machine, as a file.

A profile holds the step cost model (`replica.StepCostModel`), the engine's scheduler limits
(sequences, token budget, KV cache), how long a replica takes to become ready, where the figures
come from and how well they fit. Measured profiles come from `tidegate sim calibrate`; the GPU
profiles shipped beside this module are estimates from roofline arithmetic and published figures,
labelled as such, each naming its sources.

Shipped profiles are found by name (`load_profile("tiny-random-llama-cpu")`), any other by path.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from tidegate.engine.scheduler import SchedulerConfig
from tidegate.sim.replica import ReplicaSpec, StepCostModel
from tidegate.sim.step_noise import StepNoise

__all__ = ["FitError", "ReplicaProfile", "load_profile", "save_profile", "shipped_profiles", "PROFILE_VERSION"]

PROFILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class FitError:
    """How well the cost model predicts step times it was not fitted on (relative errors)."""

    held_out_samples: int
    held_out_mean: float
    held_out_max: float
    fitted_samples: int


@dataclass(frozen=True, slots=True)
class ReplicaProfile:
    name: str
    description: str
    estimate: bool  # from formulas and published figures, not measured on the engine
    sources: tuple[str, ...]
    cost: StepCostModel
    max_num_seqs: int
    max_batch_tokens: int
    kv_cache_tokens: int
    cold_start_s: float  # from "replica requested" to "ready": process start, weights load, warm-up
    fit: FitError | None = None
    # the engine's budget charge for a prefill token at context c is 1 + c / this (the embedded
    # engine's `SchedulerConfig.attention_cost_tokens`); None: 1 a token
    attention_cost_tokens: int | None = None
    # how a served step's time varies around the cost model's mean (`sim.step_noise`), fitted on
    # logged steps; None (profiles without it): every modelled step takes the mean exactly
    noise: StepNoise | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_batch_tokens < 1 or self.kv_cache_tokens < 1 or self.cold_start_s < 0:
            raise ValueError(f"profile {self.name}: limits must be >= 1 and cold_start_s >= 0")
        costs = (self.cost.base_s, self.cost.prefill_s_per_token, self.cost.decode_s_per_seq,
                 self.cost.context_s_per_token, self.cost.decode_attention_s_per_position,
                 self.cost.prefill_context_s_per_token)
        if min(costs) < 0 or self.cost.base_s <= 0:
            raise ValueError(f"profile {self.name}: costs must be >= 0 and base_s > 0")
        for table_name in ("decode_s_by_batch", "forward_s_by_rows"):
            table = getattr(self.cost, table_name)
            points = [b for b, _ in table]
            if points != sorted(set(points)) or any(b < 1 for b in points) or any(t < 0 for _, t in table):
                raise ValueError(f"profile {self.name}: {table_name} needs increasing points >= 1 and costs >= 0")
        if self.cost.forward_s_per_row < 0:
            raise ValueError(f"profile {self.name}: forward_s_per_row must be >= 0")

    def spec(self, replica_id: str, noise_seed: int = 0) -> ReplicaSpec:
        """A modelled replica of this profile; `noise_seed` draws its step noise, if the profile has one."""
        return ReplicaSpec(replica_id, scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                                                 max_batch_tokens=self.max_batch_tokens,
                                                                 attention_cost_tokens=self.attention_cost_tokens),
                           kv_cache_tokens=self.kv_cache_tokens, cost=self.cost, cold_start_s=self.cold_start_s,
                           noise=self.noise, noise_seed=noise_seed)

    def to_json(self) -> str:
        data = {"version": PROFILE_VERSION, **asdict(self)}
        data["sources"] = list(self.sources)
        data["cost"]["decode_s_by_batch"] = [list(point) for point in self.cost.decode_s_by_batch]
        if self.cost.forward_s_by_rows:
            data["cost"]["forward_s_by_rows"] = [list(point) for point in self.cost.forward_s_by_rows]
        else:  # the profiles written before the forward table existed read as they did
            del data["cost"]["forward_s_by_rows"], data["cost"]["forward_s_per_row"]
        for name in ("decode_attention_s_per_position", "prefill_context_s_per_token"):
            if not getattr(self.cost, name):  # nor those before the decode attention's terms
                del data["cost"][name]
        if self.noise is None:  # profiles without it read as they did
            del data["noise"]
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "<profile>") -> ReplicaProfile:
        try:
            data = json.loads(text)
            version = data.pop("version", None)
            if version != PROFILE_VERSION:
                raise ValueError(f"version {version!r}, expected {PROFILE_VERSION}")
            cost_fields = data.pop("cost")
            table = tuple((int(b), float(t)) for b, t in cost_fields.pop("decode_s_by_batch", ()))
            forward = tuple((int(r), float(t)) for r, t in cost_fields.pop("forward_s_by_rows", ()))
            cost = StepCostModel(**cost_fields, decode_s_by_batch=table, forward_s_by_rows=forward)
            fit = data.pop("fit", None)
            noise = data.pop("noise", None)
            return cls(cost=cost, fit=FitError(**fit) if fit is not None else None,
                       noise=StepNoise(**noise) if noise is not None else None,
                       sources=tuple(data.pop("sources", ())), **data)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ValueError(f"{source}: not a replica profile: {error}") from None


def _shipped_dir() -> Path:
    return Path(str(resources.files("tidegate.sim") / "profiles"))


def shipped_profiles() -> tuple[str, ...]:
    """Names of the profiles shipped with the package."""
    return tuple(sorted(p.stem for p in _shipped_dir().glob("*.json")))


def load_profile(name_or_path: str | Path) -> ReplicaProfile:
    """A shipped profile by name, or a profile file by path. Raises ValueError naming what is wrong."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = _shipped_dir() / f"{name_or_path}.json"
        if not path.exists():
            raise ValueError(f"no shipped profile {name_or_path!r}; shipped: {', '.join(shipped_profiles())}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"{path}: cannot read: {error.strerror}") from None
    return ReplicaProfile.from_json(text, source=str(path))


def save_profile(profile: ReplicaProfile, path: str | Path) -> None:
    Path(path).write_text(profile.to_json(), encoding="utf-8")
