"""Scraping: which /metrics samples are kept."""

from __future__ import annotations

from tidegate.loadgen.driver import parse_prometheus

EXPOSITION = """# HELP tidegate_queue_depth Requests waiting
# TYPE tidegate_queue_depth gauge
tidegate_queue_depth{tier="critical",pool="a b"} 3
tidegate_queue_depth{tier="sheddable"} 17 1700000000000
tidegate_replicas 2
process_cpu_seconds_total 12.5
engine_kv_cache_usage 0.42
"""


def test_keeps_samples_whose_name_matches_with_labels_and_timestamps() -> None:
    assert parse_prometheus(EXPOSITION, ["queue", "replica", "kv"]) == [
        ('tidegate_queue_depth{tier="critical",pool="a b"}', 3.0),
        ('tidegate_queue_depth{tier="sheddable"}', 17.0),
        ("tidegate_replicas", 2.0),
        ("engine_kv_cache_usage", 0.42),
    ]


def test_label_values_do_not_match_patterns() -> None:
    assert parse_prometheus('other_metric{name="queue"} 1\n', ["queue"]) == []
