"""The metrics the docs document (docs/operations.md, Metrics) are the ones the code defines; the Grafana
dashboard uses only those."""

import json
import pathlib
import re

from scheduler_service.process.metrics import METRICS as SCHEDULER_METRICS
from worker_service.serving.metrics import METRICS as WORKER_METRICS

ROOT = pathlib.Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "specdec-dashboard.json"
_ROW = re.compile(r"^\| `(specdec_\w+)` \| (\w+) \| ([^|]*) \|", re.MULTILINE)
_NAME = re.compile(r"specdec_\w+")


def defined() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every metric of both services: name -> (type, labels)."""
    metrics = {m.name: (m.kind, m.labels) for m in SCHEDULER_METRICS}
    metrics.update({name: (kind, ()) for name, kind, _ in WORKER_METRICS})
    return metrics


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """The metric tables of docs/operations.md: name -> (type, labels)."""
    rows = _ROW.findall((ROOT / "docs" / "operations.md").read_text())
    assert len(rows) == len({name for name, _, _ in rows}), "a metric is listed twice"
    return {name: (kind, tuple(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}


def test_readme_tables_list_every_metric_with_its_type_and_labels():
    assert len(SCHEDULER_METRICS) + len(WORKER_METRICS) == len(defined())  # no name defined twice
    assert documented() == defined()


def test_metric_names_say_their_unit_or_count():
    for name, (kind, _) in defined().items():
        assert re.fullmatch(r"specdec_[a-z0-9_]+", name), name  # no colon: Prometheus keeps those for rules
        if kind == "counter":
            assert name.endswith("_total"), name
        if kind == "histogram":
            assert name.endswith(("_seconds", "_num_seqs")), name


def test_grafana_dashboard_queries_only_documented_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    allowed = set()
    for name, (kind, _) in documented().items():
        allowed |= {name} | ({f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else set())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(dashboard["panels"]) >= 10 and all(exprs)
    used = {name for expr in exprs for name in _NAME.findall(expr)}
    assert used <= allowed, used - allowed
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert all(target["datasource"]["uid"] == "${DS_PROMETHEUS}" for target in panel["targets"])
    # The panels the README promises: the acceptance rate and the per-position acceptance among them.
    for name in (
        "specdec_spec_decode_num_accepted_tokens_per_pos_total",
        "specdec_request_success_total",
        "specdec_kv_cache_usage_perc",
        "specdec_worker_step_propose_seconds_sum",
        "specdec_time_to_first_token_seconds_bucket",
        "specdec_inter_token_latency_seconds_bucket",
        "specdec_e2e_request_latency_seconds_bucket",
        "specdec_moved_requests_total",
    ):
        assert name in used, name
