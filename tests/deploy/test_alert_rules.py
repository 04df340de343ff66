"""deploy/prometheus/alerts.yaml: valid rules, and `promtool test rules` cases that fire and stay silent."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: Debian package `prometheus` "
                                    "(.ci/run installs it)")


def _alert_names() -> list[str]:
    groups = yaml.safe_load((RULES_DIR / "alerts.yaml").read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


@needs_promtool
def test_the_rule_file_is_valid() -> None:
    result = subprocess.run([PROMTOOL, "check", "rules", "alerts.yaml"], cwd=RULES_DIR, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_every_alert_fires_where_it_should_and_stays_silent_where_it_should_not() -> None:
    result = subprocess.run([PROMTOOL, "test", "rules", "alerts_test.yaml"], cwd=RULES_DIR, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_case_that_fires_and_one_that_stays_silent() -> None:
    tests = yaml.safe_load((RULES_DIR / "alerts_test.yaml").read_text())["tests"]
    cases = [case for test in tests for case in test.get("alert_rule_test", [])]
    for name in _alert_names():
        outcomes = [bool(case["exp_alerts"]) for case in cases if case["alertname"] == name]
        assert True in outcomes and False in outcomes, f"{name}: needs a firing and a silent case"


def test_the_seeds_triggers_are_there() -> None:
    """Saturation for 5 minutes, queue depth over 100, TTFT P99 over 1.2x the tier target, burn rates."""
    names = set(_alert_names())
    assert {"TidegateReplicaSaturated", "TidegateQueueDeep", "TidegateTTFTOverTarget", "TidegateLatencySLOFastBurn",
            "TidegateLatencySLOSlowBurn", "TidegateErrorSLOFastBurn", "TidegateErrorSLOSlowBurn",
            "TidegateRejectionRatioHigh", "TidegateReplicaDown", "TidegateTargetDown"} <= names
