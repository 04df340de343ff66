"""Length classes: a pool may split short and long prompts onto separate replica sets. Pure.

A long prompt's prefill holds up every short prompt's first token on the engine it shares (TTFT is
set by the prefill tokens ahead), so a pool can keep some replicas for short prompts and others for
long ones. Classes are ordered by their prompt-token bound, the last unbounded; a request belongs
to the first class whose bound its prompt-token estimate does not exceed, and the pool controller
picks only among that class's replicas (`test_a_request_goes_only_to_its_length_class_replicas`).
When none of the class's replicas is routable the request may go anywhere in the pool rather than
wait for nothing (`test_a_request_falls_back_to_the_whole_pool_when_its_class_is_down`); a class
whose replicas are only full waits for them (`test_a_full_class_waits_for_its_own_replicas`). Rule 9
stops background work only on the waiting request's class
(`test_background_work_outside_a_request_s_class_is_not_preempted_for_it`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["LengthClass", "LengthClasses"]


@dataclass(frozen=True, slots=True)
class LengthClass:
    max_prompt_tokens: int | None  # prompts of at most this many tokens; None: any (the last class)
    replicas: frozenset[str]  # the replica ids that serve this class


@dataclass(frozen=True, slots=True)
class LengthClasses:
    classes: tuple[LengthClass, ...]

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("length classes: at least one class needed")
        bounds = [c.max_prompt_tokens for c in self.classes]
        if bounds[-1] is not None or any(b is None for b in bounds[:-1]):
            raise ValueError("length classes: every class but the last needs max_prompt_tokens; the last none")
        finite = [b for b in bounds if b is not None]
        if any(b < 1 for b in finite) or any(a >= b for a, b in zip(finite, finite[1:])):
            raise ValueError("length classes: max_prompt_tokens must be >= 1 and strictly increasing")
        if any(not c.replicas for c in self.classes):
            raise ValueError("length classes: every class needs at least one replica")

    def replicas_for(self, prompt_tokens: int) -> frozenset[str]:
        """The replicas of the class a prompt of `prompt_tokens` tokens belongs to."""
        for length_class in self.classes:
            bound = length_class.max_prompt_tokens
            if bound is None or prompt_tokens <= bound:
                return length_class.replicas
        raise AssertionError("the last class is unbounded")

    def outside(self, prompt_tokens: int, replica_ids: Iterable[str],
                routable: Callable[[str], bool]) -> frozenset[str] | None:
        """The replicas of `replica_ids` a prompt of `prompt_tokens` tokens must not go to: those
        outside its class. None: no replica of its class is routable, so it may go to any."""
        own = self.replicas_for(prompt_tokens)
        if not any(routable(r) for r in own):
            return None
        return frozenset(r for r in replica_ids if r not in own)
