"""Tenants, token-length distributions and synthetic prompts."""

from __future__ import annotations

import numpy as np
import pytest

from tidegate.loadgen.mix import (
    Tenant, assign_tenants, load_mix_file, parse_length, parse_tenant, synthetic_prompt,
)


def test_tenant_spec_parses_all_four_fields() -> None:
    assert parse_tenant("acme:sk-1:critical:0.25") == Tenant("acme", "sk-1", "critical", 0.25)


@pytest.mark.parametrize("spec", ["acme:sk:critical", "acme:sk:critical:0", ":sk:critical:1", "a:k:t:x"])
def test_bad_tenant_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_tenant(spec)


def test_mix_file_lists_tenants(tmp_path) -> None:
    path = tmp_path / "mix.yaml"
    path.write_text("tenants:\n  - {name: a, key: ka, tier: critical, share: 3}\n  - {name: b, tier: sheddable}\n")
    assert load_mix_file(path) == [Tenant("a", "ka", "critical", 3.0), Tenant("b", "", "sheddable", 1.0)]


def test_tenants_are_assigned_by_share() -> None:
    tenants = [Tenant("a", "", "t", 3.0), Tenant("b", "", "t", 1.0)]
    picks = assign_tenants(np.random.default_rng(0), tenants, 20_000)
    assert np.mean(picks == 0) == pytest.approx(0.75, abs=0.02)


@pytest.mark.parametrize("spec, low, high", [("const:7", 7, 7), ("uniform:10:20", 10, 20), ("lognormal:100:0.5", 1, 10**6)])
def test_lengths_stay_in_range(spec: str, low: int, high: int) -> None:
    values = parse_length(spec).sample(np.random.default_rng(0), 5000)
    assert values.min() >= low and values.max() <= high


def test_lognormal_length_has_the_given_median() -> None:
    values = parse_length("lognormal:200:0.7").sample(np.random.default_rng(0), 20_000)
    assert np.median(values) == pytest.approx(200, rel=0.03)


@pytest.mark.parametrize("spec", ["const", "uniform:5", "uniform:9:3", "gauss:1:2", "const:x"])
def test_bad_length_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_length(spec)


@pytest.mark.parametrize("tokens", [1, 5, 128, 3000])
def test_synthetic_prompt_has_exactly_the_target_bytes(tokens: int) -> None:
    prompt = synthetic_prompt(tokens, nonce=42)
    assert len(prompt.encode("utf-8")) == tokens


def test_synthetic_prompts_differ_by_nonce() -> None:
    assert synthetic_prompt(100, 1) != synthetic_prompt(100, 2)
