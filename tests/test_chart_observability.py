"""The operator's view the chart ships: its Grafana dashboard, its alerts, and the datasource
that links the dashboard's exemplars to traces, checked against what the tiers export.

- The dashboard (files/dashboard.json) is what deploy/k8s/dashboard.py generates; it shows
  per-tier saturation, the stage breakdown, the caches and the retries; every query names
  series and labels the tiers export (tests/exported_series.py) and parses (`promtool check
  rules`, each query as a recording rule); every latency-histogram query asks for exemplars.
- The PrometheusRule's alerts read exported series, pass `promtool check rules`, and pass
  `promtool test rules` (tests/promtool/alerts_test.yaml): each alert fires on synthetic
  series of its trouble and stays quiet on healthy ones; each threshold value reaches its
  alert and the schema refuses a nonsensical one.
- `grafanaDashboard.datasource` provisions a Prometheus datasource whose exemplars open in
  the configured trace datasource, under the label the tiers attach their trace ids with.

promtool is Debian's (`make test` fetches it into .tools/); without it the promtool steps
skip and the rest still runs.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import test_helm_chart
import yaml
from exported_series import exported_series, selector_problems
from test_helm_chart import CHART, NEWEST_K8S, RELEASE, ROOT, find, helm_run, render

helm = test_helm_chart.helm  # the chart tests' fixture: .tools/helm, installed where missing

DASHBOARD_PY = ROOT / "deploy" / "k8s" / "dashboard.py"
ALERT_TESTS = Path(__file__).parent / "promtool" / "alerts_test.yaml"
ALERTS = {"TandemErrorRatioHigh", "TandemTTFTHigh", "TandemTransferFaults", "TandemKVCacheFull",
          "TandemTierDown", "TandemRoomStuck", "TandemRetryStorm", "TandemEncoderCacheThrash",
          "TandemPrefixCacheThrash"}
# the thresholds tests/promtool/alerts_test.yaml is written for (set explicitly, so a new
# default in values.yaml does not move them)
THRESHOLDS = {"prometheusRule.errorRatio": "0.05", "prometheusRule.ttftP99Seconds": "10",
              "prometheusRule.transferFaults": "0", "prometheusRule.kvUsage": "0.95",
              "prometheusRule.stuckRoomTimeouts": "3", "transfer.timeoutS": "10",
              "prometheusRule.retryRatio": "0.1", "prometheusRule.retriesPerSecond": "0.05",
              "prometheusRule.cacheThrash.hitRatio": "0.2",
              "prometheusRule.cacheThrash.encoderEvictionsPerSecond": "1",
              "prometheusRule.cacheThrash.prefixEvictionsPerSecond": "50"}
# what each row of the dashboard must show (series its queries read)
SHOWN = {
    "Saturation": {"tandem_encoder_pending_patches", "tandem_encoder_vit_seconds_sum",
                   "tandem_language_kv_pages_used", "tandem_language_waiting_requests",
                   "tandem_transfer_blocks_free", "tandem_transfer_blocks_capacity",
                   "tandem_language_busy_seconds_total", "tandem_router_inflight"},
    "Stage breakdown": {"tandem_language_request_queue_time_seconds_bucket",
                        "tandem_encoder_preprocess_seconds_bucket",
                        "tandem_encoder_vit_seconds_bucket", "tandem_transfer_seconds_bucket",
                        "tandem_language_request_prefill_time_seconds_bucket",
                        "tandem_language_request_decode_time_seconds_bucket"},
    "Caches": {"tandem_encoder_cache_hits_total", "tandem_encoder_cache_misses_total",
               "tandem_encoder_cache_evictions_total",
               "tandem_language_prefix_cache_hit_tokens_total",
               "tandem_language_prefix_cache_query_tokens_total",
               "tandem_language_prefix_cache_evictions_total"},
    "Retries, failovers and transfers": {"tandem_router_encoder_retries_total",
                                         "tandem_router_request_retries_total",
                                         "tandem_transfer_failures_total",
                                         "tandem_transfer_room_stall_seconds"},
}
SERIES = re.compile(r"\btandem_[a-z0-9_]+\b")


@pytest.fixture(scope="module")
def exported() -> dict[str, frozenset[str]]:
    return exported_series()


@pytest.fixture(scope="module")
def dashboard(helm) -> dict:
    objs = render(helm, "--set", "grafanaDashboard.enabled=true")
    return json.loads(find(objs, "ConfigMap", f"{RELEASE}-dashboard")["data"]["tandem.json"])


@pytest.fixture(scope="module")
def rule(helm) -> dict:
    sets = [a for k, v in THRESHOLDS.items() for a in ("--set-json", f"{k}={v}")]
    return find(render(helm, "--set", "prometheusRule.enabled=true", *sets),
                "PrometheusRule", RELEASE)


def promtool() -> str:
    found = shutil.which("promtool") or str(ROOT / ".tools" / "promtool")
    if not Path(found).exists():
        pytest.skip("promtool not installed (Debian's `prometheus`; `make test` fetches it)")
    return found


def promtool_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def check_rules(groups: list[dict], path: Path) -> subprocess.CompletedProcess:
    """`promtool check rules` on `groups`, and on the same groups with one unparsable rule
    added, which must fail: promtool read the rules (its exit status, not its wording)."""
    broken = [*groups, {"name": "control", "rules": [{"record": "control:broken",
                                                      "expr": "sum(rate("}]}]
    path.write_text(yaml.safe_dump({"groups": broken}))
    r = promtool_run("check", "rules", str(path))
    assert r.returncode != 0, r.stdout + r.stderr
    path.write_text(yaml.safe_dump({"groups": groups}))
    return promtool_run("check", "rules", str(path))


def targets(dash: dict):
    """(panel, target) of every query on the dashboard."""
    for p in dash["panels"]:
        for t in p.get("targets", []):
            yield p, t


def rules_of(rule: dict) -> list[dict]:
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


# ---- the dashboard ---------------------------------------------------------------------------

def test_the_dashboard_is_the_generated_one():
    r = subprocess.run([sys.executable, str(DASHBOARD_PY), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_every_dashboard_query_reads_exported_series(dashboard, exported):
    found = [f"{p['title']} {t['refId']}: {why}" for p, t in targets(dashboard)
             for why in selector_problems(t["expr"], exported)]
    assert not found, "\n".join(found)


def test_the_checker_catches_a_series_or_label_no_tier_exports(exported):
    bad = ('sum by (reason, shard) (rate(tandem_transfer_failures_total{reason="transfer", '
           'tier="x"}[5m])) / tandem_encoder_cache_hit_total')
    assert len(selector_problems(bad, exported)) == 3


def test_every_dashboard_query_parses(dashboard, tmp_path):
    """Each query as a recording rule (Grafana's $__rate_interval as a fixed window)."""
    rules = [{"record": f"dashboard:panel_{p['id']}_{t['refId']}",
              "expr": t["expr"].replace("$__rate_interval", "5m")} for p, t in targets(dashboard)]
    assert rules
    r = check_rules([{"name": "dashboard", "rules": rules}], tmp_path / "dashboard-queries.yaml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dashboard_shows_saturation_stages_caches_and_retries(dashboard):
    rows, row = {}, None
    for p in dashboard["panels"]:
        if p["type"] == "row":
            row = rows.setdefault(p["title"], set())
        else:
            row |= {s for t in p["targets"] for s in SERIES.findall(t["expr"])}
    for title, series in SHOWN.items():
        assert series <= rows.get(title, set()), (title, series - rows.get(title, set()))


def test_latency_histograms_link_exemplars_to_traces(dashboard):
    """Every query over a latency histogram's buckets asks Grafana for exemplars (the dots
    that open a request's trace); no other query does (exemplars are on bucket samples)."""
    asked = {(p["title"], t["refId"]): t["exemplar"] for p, t in targets(dashboard)}
    reads_buckets = {(p["title"], t["refId"]): "_bucket" in t["expr"]
                     for p, t in targets(dashboard)}
    assert asked == reads_buckets
    assert sum(asked.values()) >= 10


def test_the_dashboard_lays_out_on_grafanas_grid(dashboard):
    """Unique ids, every panel on the 24-column grid with no two overlapping, and every
    query on the dashboard's Prometheus datasource variable."""
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (p["title"], cells.get((x, y)))
                cells[(x, y)] = p["title"]
    var = {v["name"]: v for v in dashboard["templating"]["list"]}["datasource"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    for p, t in targets(dashboard):
        assert p["datasource"]["uid"] == t["datasource"]["uid"] == "${datasource}", p["title"]
        assert len({x["refId"] for x in p["targets"]}) == len(p["targets"]), p["title"]


# ---- the alerts ------------------------------------------------------------------------------

def test_alerts_read_exported_series(rule, exported):
    rules = rules_of(rule)
    assert {r["alert"] for r in rules} == ALERTS
    found = [f"{r['alert']}: {why}" for r in rules for why in selector_problems(r["expr"], exported)]
    assert not found, "\n".join(found)


def test_alerts_pass_promtool_check_rules(rule, tmp_path):
    r = check_rules(rule["spec"]["groups"], tmp_path / "rules.yaml")
    assert r.returncode == 0 and not r.stderr.strip(), r.stdout + r.stderr


def _labels_filled(text: str, labels: dict[str, str]) -> str:
    """An annotation as Prometheus expands it for an alert with `labels` (the rules use
    `{{ $labels.NAME }}` and nothing else)."""
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), text)


def test_each_alert_fires_on_its_trouble_and_stays_quiet_when_healthy(rule, exported, tmp_path):
    """`promtool test rules` on synthetic series: each alert fires in one scenario, with the
    labels (and so the pod) it names, and is quiet in another."""
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    by_name = {r["alert"]: r for r in rules_of(rule)}
    fires, quiet = set(), set()
    for case in tests["tests"]:
        for s in case["input_series"]:  # the scenarios use only series the tiers export
            assert not selector_problems(s["series"], exported), s["series"]
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
            for a in check["exp_alerts"]:
                a["exp_annotations"] = {
                    k: _labels_filled(v, a["exp_labels"])
                    for k, v in by_name[check["alertname"]]["annotations"].items()}
    assert fires == quiet == ALERTS, (ALERTS - fires, ALERTS - quiet)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    (tmp_path / "alerts_test.yaml").write_text(yaml.safe_dump(tests))
    r = promtool_run("test", "rules", str(tmp_path / "alerts_test.yaml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_rule_that_never_fires_fails_the_alert_tests(rule, tmp_path):
    """The promtool scenarios can fail: with the stuck-room threshold out of reach, the
    scenario expecting TandemRoomStuck fails; as shipped, the same scenario passes."""
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    (case,) = [c for c in tests["tests"] if c["name"] == "stuck room"]
    (stuck,) = [r for r in rules_of(rule) if r["alert"] == "TandemRoomStuck"]
    for a in (a for c in case["alert_rule_test"] for a in c["exp_alerts"]):
        a["exp_annotations"] = {k: _labels_filled(v, a["exp_labels"])
                                for k, v in stuck["annotations"].items()}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({**tests, "tests": [case]}))

    def scenario(groups: list[dict]) -> subprocess.CompletedProcess:
        (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
        return promtool_run("test", "rules", str(tmp_path / "t.yaml"))

    r = scenario(rule["spec"]["groups"])
    assert r.returncode == 0, r.stdout + r.stderr
    groups = copy.deepcopy(rule["spec"]["groups"])
    for r in (r for g in groups for r in g["rules"]):
        if r["alert"] == "TandemRoomStuck":
            r["expr"] = r["expr"].replace("> 30", "> 3000")
    r = scenario(groups)
    assert r.returncode != 0, r.stdout + r.stderr


@pytest.mark.parametrize("values, alert, shown", [
    ({"prometheusRule.stuckRoomTimeouts": "4", "transfer.timeoutS": "15"},
     "TandemRoomStuck", "> 60"),
    ({"prometheusRule.retryRatio": "0.25"}, "TandemRetryStorm", "> 0.25"),
    ({"prometheusRule.retriesPerSecond": "0.5"}, "TandemRetryStorm", "> 0.5"),
    ({"prometheusRule.cacheThrash.hitRatio": "0.35"}, "TandemEncoderCacheThrash", "< 0.35"),
    ({"prometheusRule.cacheThrash.hitRatio": "0.35"}, "TandemPrefixCacheThrash", "< 0.35"),
    ({"prometheusRule.cacheThrash.encoderEvictionsPerSecond": "7"},
     "TandemEncoderCacheThrash", "> 7"),
    ({"prometheusRule.cacheThrash.prefixEvictionsPerSecond": "700"},
     "TandemPrefixCacheThrash", "> 700"),
])
def test_each_threshold_reaches_its_alert(helm, values, alert, shown):
    sets = [a for k, v in values.items() for a in ("--set-json", f"{k}={v}")]
    rule = find(render(helm, "--set", "prometheusRule.enabled=true", *sets), "PrometheusRule",
                RELEASE)
    (r,) = [r for r in rules_of(rule) if r["alert"] == alert]
    assert re.search(rf"{re.escape(shown)}\s*(\n|$)", r["expr"]), r["expr"]


@pytest.mark.parametrize("value, sensible", [
    ("prometheusRule.cacheThrash.hitRatio=1.5", "prometheusRule.cacheThrash.hitRatio=0.5"),
    ("prometheusRule.stuckRoomTimeouts=0", "prometheusRule.stuckRoomTimeouts=1"),
    ("prometheusRule.retryRatio=0", "prometheusRule.retryRatio=0.01"),
    ("prometheusRule.cacheThrash.evictions=3",
     "prometheusRule.cacheThrash.encoderEvictionsPerSecond=3"),
])
def test_a_nonsensical_threshold_is_refused(helm, value, sensible):
    """Refused by the chart (its exit status; the schema error's wording is helm's), where
    a sensible value of the same setting renders."""
    def template(v: str) -> subprocess.CompletedProcess:
        return helm_run(helm, "template", RELEASE, str(CHART), "--set",
                        "prometheusRule.enabled=true", "--set-json", v)

    ok = template(sensible)
    assert ok.returncode == 0, ok.stderr
    r = template(value)
    assert r.returncode != 0, r.stdout


# ---- the datasource: exemplars link to traces ------------------------------------------------

def test_no_datasource_unless_asked(helm):
    objs = render(helm, "--set", "grafanaDashboard.enabled=true")
    assert not [o for o in objs if o["metadata"]["name"] == f"{RELEASE}-datasource"]


def test_a_datasource_without_a_url_is_refused(helm):
    r = helm_run(helm, "template", RELEASE, str(CHART),
                 "--set", "grafanaDashboard.datasource.enabled=true")
    assert r.returncode != 0 and "grafanaDashboard.datasource.url" in r.stderr


def test_the_datasource_links_exemplars_to_the_trace_datasource(helm):
    objs = render(helm, "--set", "grafanaDashboard.datasource.enabled=true",
                  "--set", "grafanaDashboard.datasource.url=http://prometheus.monitoring:9090",
                  "--set", "grafanaDashboard.traces.datasourceUid=tempo")
    cm = find(objs, "ConfigMap", f"{RELEASE}-datasource")
    kubernetes_validate.validate(cm, NEWEST_K8S, strict=True)
    values = yaml.safe_load((CHART / "values.yaml").read_text())["grafanaDashboard"]
    assert values["datasource"]["labels"].items() <= cm["metadata"]["labels"].items()
    (prov,) = cm["data"].values()
    (ds,) = yaml.safe_load(prov)["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus.monitoring:9090"
    assert ds["uid"] == values["datasource"]["uid"]
    assert ds["jsonData"]["exemplarTraceIdDestinations"] == [
        {"name": values["traces"]["traceIdLabel"], "datasourceUid": "tempo"}]
    # without a trace datasource, exemplars show with no link
    objs = render(helm, "--set", "grafanaDashboard.datasource.enabled=true",
                  "--set", "grafanaDashboard.datasource.url=http://p:9090")
    (prov,) = find(objs, "ConfigMap", f"{RELEASE}-datasource")["data"].values()
    assert yaml.safe_load(prov)["datasources"][0]["jsonData"]["exemplarTraceIdDestinations"] == []


def test_the_trace_id_label_is_the_one_the_tiers_attach():
    """grafanaDashboard.traces.traceIdLabel names the exemplar label the tiers put a sampled
    request's trace id under (tandem/tracing.py `exemplar`)."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    from tandem.tracing import exemplar

    span = NonRecordingSpan(SpanContext(trace_id=0xABC, span_id=0x1, is_remote=False,
                                        trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    label = yaml.safe_load((CHART / "values.yaml").read_text())[
        "grafanaDashboard"]["traces"]["traceIdLabel"]
    assert set(exemplar(span)) == {label}
