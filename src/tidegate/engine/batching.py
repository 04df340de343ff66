"""When to run an embeddings batch and which texts go in it. Pure: time comes in as `now_s`.

Texts wait in arrival order. A round runs once `max_batch_size` texts wait, or `max_batch_tokens`
tokens, or the oldest text has waited `max_queue_delay_s` (Triton's dynamic batcher). The round
takes the oldest texts, at most `max_batches_per_round` batches' worth, sorts them by token count
and cuts the sorted run into batches of at most `max_batch_size` texts and `max_batch_tokens`
padded positions. Texts of like length then share a batch, so little compute goes to padding
(every text of a batch is padded to its longest), and long texts go in smaller batches. Taking
the oldest first keeps it fair: no text waits more than a round behind later arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Sequence

__all__ = ["BatchAction", "BatchDecision", "BatchFormingPolicy", "PendingText", "padded_tokens"]


@dataclass(frozen=True, slots=True)
class PendingText:
    """One text of one request, waiting to be embedded."""

    request_id: int
    index: int  # position of the text in its request's input
    tokens: int  # tokens it will be embedded with (specials included, truncated)
    arrived_s: float


class BatchAction(Enum):
    IDLE = "idle"  # nothing waits: sleep until a text arrives
    WAIT = "wait"  # texts wait, but no full batch and no overdue text: sleep until `wake_at_s`
    RUN = "run"  # run `batches`, in order


@dataclass(frozen=True, slots=True)
class BatchDecision:
    action: BatchAction
    batches: tuple[tuple[PendingText, ...], ...] = ()
    wake_at_s: float | None = None  # set for WAIT


def padded_tokens(batch: Sequence[PendingText]) -> int:
    """Token positions the model computes for `batch`: every text is padded to the longest."""
    return len(batch) * max((text.tokens for text in batch), default=0)


class BatchFormingPolicy:
    def __init__(self, *, max_batch_size: int, max_queue_delay_s: float, max_batch_tokens: int = 2048,
                 sort_by_length: bool = True, max_batches_per_round: int = 4) -> None:
        if max_batch_size < 1 or max_batches_per_round < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_size, max_batch_tokens and max_batches_per_round must be >= 1")
        if max_queue_delay_s < 0:
            raise ValueError("max_queue_delay_s must be >= 0")
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.max_batch_tokens = max_batch_tokens
        self.sort_by_length = sort_by_length
        self.max_batches_per_round = max_batches_per_round

    def decide(self, pending: Sequence[PendingText], now_s: float) -> BatchDecision:
        """`pending` in arrival order (oldest first)."""
        if not pending:
            return BatchDecision(BatchAction.IDLE)
        deadline_s = pending[0].arrived_s + self.max_queue_delay_s
        full = len(pending) >= self.max_batch_size or sum(t.tokens for t in pending) >= self.max_batch_tokens
        if not full and now_s < deadline_s:
            return BatchDecision(BatchAction.WAIT, wake_at_s=deadline_s)
        round_texts = list(pending[: self.max_batch_size * self.max_batches_per_round])
        if self.sort_by_length:
            round_texts.sort(key=lambda text: text.tokens)  # stable: equal lengths keep arrival order
        return BatchDecision(BatchAction.RUN, batches=self._cut(round_texts))

    def _cut(self, texts: list[PendingText]) -> tuple[tuple[PendingText, ...], ...]:
        """Consecutive batches within the size and padded-token limits (a lone text always fits)."""
        batches: list[tuple[PendingText, ...]] = []
        current: list[PendingText] = []
        longest = 0
        for text in texts:
            grown_longest = max(longest, text.tokens)
            if current and (len(current) == self.max_batch_size
                            or (len(current) + 1) * grown_longest > self.max_batch_tokens):
                batches.append(tuple(current))
                current, grown_longest = [], text.tokens
            current.append(text)
            longest = grown_longest
        if current:
            batches.append(tuple(current))
        return tuple(batches)
