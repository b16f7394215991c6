"""docs/grafana/pagedweight-dashboard.json: a well-formed Grafana dashboard that charts every PagedWeight gauge and
queries only metrics that exist (PagedWeight's gauges, and SGLang 0.5.17's own by their names in its metrics
collector). tests/test_e2e_paging.py::test_prometheus_gauges checks the same names against a live server's /metrics.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pagedweight.serving.metrics import GAUGES, METRIC_PREFIX

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "pagedweight-dashboard.json"
_METRIC = re.compile(r"sglang:[a-z_]+")


def dashboard_metrics(doc: dict) -> set[str]:
    """Every metric name a panel target or a template variable queries."""
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in doc["templating"]["list"] if v["type"] == "query"]
    return {m for e in exprs for m in _METRIC.findall(e)}


def test_dashboard_charts_every_gauge_and_only_known_metrics():
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] and doc["title"] and doc["panels"]
    names = dashboard_metrics(doc)
    ours = {n for n in names if n.startswith(METRIC_PREFIX)}
    assert ours == {METRIC_PREFIX + k for k in GAUGES}, "every PagedWeight gauge charted, no unknown one"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for p in doc["panels"]:  # every panel and target reads the data source chosen in the dashboard's variable
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")") and t["expr"].count("{") == t["expr"].count("}")
            if METRIC_PREFIX in t["expr"]:  # ours filtered by the instance and TP-rank variables
                assert 'instance=~"$instance"' in t["expr"] and 'tp_rank=~"$tp_rank"' in t["expr"]
    assert {v["name"] for v in doc["templating"]["list"]} == {"datasource", "instance", "tp_rank"}


def test_dashboard_sglang_metrics_exist_in_sglang():
    from sglang.srt.observability import metrics_collector  # SGLang 0.5.17 (a test dependency)

    source = Path(metrics_collector.__file__).read_text()
    sglang_names = {n for n in dashboard_metrics(json.loads(DASHBOARD.read_text())) if not n.startswith(METRIC_PREFIX)}
    assert sglang_names, "the dashboard shows SGLang's request and KV gauges beside ours"
    for name in sglang_names:
        assert f'name="{name}"' in source, f"{name} is not a metric of SGLang's collector"
