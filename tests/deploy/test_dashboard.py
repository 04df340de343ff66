"""deploy/grafana/tidegate.json: the committed file is `tidegate.telemetry.dashboard`'s output, and a
dashboard Grafana imports (ids, grid, datasource variable, a query in every panel)."""

from __future__ import annotations

import json
from pathlib import Path

from tidegate.telemetry import dashboard

COMMITTED = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tidegate.json"


def test_the_committed_dashboard_is_the_generated_one() -> None:
    assert COMMITTED.read_text() == dashboard.render(), \
        "regenerate: python -m tidegate.telemetry.dashboard > deploy/grafana/tidegate.json"


def test_the_dashboard_has_the_rows_operators_look_for() -> None:
    rows = [panel["title"] for panel in dashboard.build()["panels"] if panel["type"] == "row"]
    assert rows == ["Traffic", "Latency by tier, against targets", "Overload: queues, refusals, degradation",
                    "Replicas: health, work budgets, engine load", "Cache", "Scaling", "Failures"]


def test_panels_are_well_formed() -> None:
    model = json.loads(COMMITTED.read_text())
    panels = model["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24
        covered = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                   for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not covered & cells, f"panel {panel['title']!r} overlaps another"
        cells |= covered
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert len({target["refId"] for target in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            assert target["expr"] and target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    variables = {variable["name"]: variable for variable in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["pool"]["includeAll"]


def test_every_query_is_listed_for_the_live_check() -> None:
    exprs = [target["expr"] for panel in dashboard.build()["panels"] for target in panel.get("targets", [])]
    assert exprs == dashboard.queries() and len(exprs) >= 25
