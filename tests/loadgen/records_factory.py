"""Builds request records for tests that need no network."""

from __future__ import annotations

from tidegate.loadgen.records import RequestRecord


def make_record(
    index: int = 0,
    *,
    status: int = 200,
    reason: str | None = None,
    ttft_s: float | None = 0.1,
    e2e_s: float | None = 1.0,
    completion_tokens: int | None = 10,
    tier: str = "standard",
    target: int = 0,
    scheduled_s: float = 0.0,
    sent_s: float = 0.0,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    return RequestRecord(
        index=index, target=target, tenant="t", tier=tier, scheduled_s=scheduled_s, sent_s=sent_s,
        status=status, reason=reason, ttft_s=ttft_s, itl_s=(), e2e_s=e2e_s, target_prompt_tokens=16,
        max_tokens=16, prompt_tokens=16, completion_tokens=completion_tokens, headers=headers or {},
    )
