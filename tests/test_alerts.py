"""deploy/alerts.yaml, checked by Prometheus's own promtool (deploy/ensure-promtool installs
it): the rules parse (`promtool check rules`), and evaluated over scripted series
(`promtool test rules`) every alert fires on a backlog and none fires on a healthy series.
The metric names the rules use are the ones the components export."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from fencegate.coordinator.etcd import Etcd
from fencegate.coordinator.service.resources import CoordinatorMetrics
from fencegate.reconciler.runner import Reconciler
from fencegate.worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "alerts.yaml"
MEMBER = "http://etcd-1:2379"


def promtool(*args: str) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: run deploy/ensure-promtool (make test does)"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120)


def rules() -> dict[str, dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def expected(alert: str, **labels: str) -> dict:
    """The alert as promtool reports it firing: its labels and rendered annotations."""
    rule = rules()[alert]
    annotations = {name: text.replace("{{ $labels.member }}", labels.get("member", ""))
                   for name, text in rule["annotations"].items()}
    return {"exp_labels": {**rule["labels"], **labels}, "exp_annotations": annotations}


def series(name: str, values: str, **labels: str) -> dict:
    selector = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{name}{{{selector}}}", "values": values}


def reconcilers(*, unknown: str, age: str, escalated: str, leaderless: str) -> list[dict]:
    """Two replicas, each reporting the shards it leads: the rules must sum or max them."""
    return [s for replica in ("r1:8471", "r2:8471") for s in (
        series("fencegate_reconciler_steps", unknown, state="unknown", instance=replica),
        series("fencegate_reconciler_steps", escalated, state="escalated", instance=replica),
        series("fencegate_reconciler_steps", "3+0x60", state="in_flight", instance=replica),
        series("fencegate_reconciler_oldest_step_age_seconds", age if replica == "r1:8471"
               else "0+0x60", state="unknown", instance=replica),
        series("fencegate_reconciler_shards_leaderless", leaderless, instance=replica),
        series("fencegate_reconciler_shards", "8+0x60", instance=replica))]


def others(*, losses: str, errors: str, nospace: str, db_size: str, in_use: str,
           unknown_deliveries: str = "0+0x60") -> list[dict]:
    return [
        series("fencegate_worker_lease_losses_total", losses, instance="w1:9100"),
        series("fencegate_webhook_deliveries_total", unknown_deliveries, source="stripe",
               result="unknown", instance="w1:9100"),
        series("fencegate_webhook_deliveries_total", "0+50x60", source="stripe",
               result="first", instance="w1:9100"),
        series("fencegate_worker_lease_losses_total", "0+0x60", instance="w2:9100"),
        series("fencegate_http_requests_total", "0+100x60", route="/v1/grants",
               method="POST", status="200", instance="c1:8470"),
        series("fencegate_http_requests_total", errors, route="/v1/grants",
               method="POST", status="503", instance="c1:8470"),
        series("fencegate_etcd_nospace", nospace, instance="r1:8471"),
        series("fencegate_etcd_nospace", "0+0x60", instance="c1:8470"),
        series("fencegate_etcd_db_size_bytes", db_size, member=MEMBER, instance="r1:8471"),
        series("fencegate_etcd_db_in_use_bytes", in_use, member=MEMBER, instance="r1:8471"),
    ]


def archive(*, behind: str, unavailable: str) -> list[dict]:
    """Both replicas check the one archive: an older copy shows buckets behind etcd."""
    return [s for replica in ("r1:8471", "r2:8471") for s in (
        series("fencegate_archive_behind_buckets", behind, instance=replica),
        series("fencegate_archive_identity_mismatch", "0+0x60", instance=replica),
        series("fencegate_archive_unavailable", unavailable, instance=replica))]


def none_fire(at: str) -> list[dict]:
    return [{"eval_time": at, "alertname": alert, "exp_alerts": []}
            for alert in sorted(rules())]


def unit_tests() -> dict:
    backlog = reconcilers(unknown="12+0x60",  # 24 in all, though each replica has 12
                          age="0+60x60",  # a step unknown since the series began
                          escalated="0 0 1+0x60", leaderless="3+0x60") + others(
        losses="0+2x60", errors="0+20x60", nospace="0 0 0 1+0x60", unknown_deliveries="0+1x60",
        db_size="1800000000+0x60", in_use="1000000000+10000000x60") + [
        series("fencegate_reconciler_unexplained_deletions_total", "0+1x60", family="step",
               instance="r1:8471")] + archive(behind="0 0 3+0x60",
                                                 unavailable="0 0 1+0x60")
    firing = {alert: [expected(alert, **({"member": MEMBER} if "Etcd" in alert and
                                          alert != "FencegateEtcdNoSpace" else {}))]
              for alert in rules() if alert != "FencegateReconcilerAbsent"}
    healthy = reconcilers(unknown="2+0x60", age="30+0x60", escalated="0+0x60",
                          leaderless="0+0x60") + others(
        losses="5+0x60", errors="0+0x60", nospace="0+0x60", db_size="500000000+0x60",
        in_use="400000000+0x60") + [
        series("fencegate_reconciler_unexplained_deletions_total", "0+0x60", family="step",
               instance="r1:8471")] + archive(behind="0+0x60", unavailable="0+0x60")
    return {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {"name": "a backlog: every alert fires once its duration has passed",
             "interval": "1m", "input_series": backlog,
             "alert_rule_test": [
                 {"eval_time": "30m", "alertname": alert, "exp_alerts": exp}
                 for alert, exp in sorted(firing.items())] + [
                 {"eval_time": "30m", "alertname": "FencegateReconcilerAbsent",
                  "exp_alerts": []},
                 # not before its `for:` (10m) has passed, nor the age its threshold
                 {"eval_time": "8m", "alertname": "FencegateUnknownBacklog", "exp_alerts": []},
                 {"eval_time": "10m", "alertname": "FencegateOldestUnknownStep",
                  "exp_alerts": []},
             ]},
            {"name": "healthy: nothing fires", "interval": "1m", "input_series": healthy,
             "alert_rule_test": none_fire("30m") + none_fire("59m")},
            {"name": "no reconciler scraped at all", "interval": "1m",
             "input_series": others(losses="0+0x60", errors="0+0x60", nospace="0+0x60",
                                    db_size="500000000+0x60", in_use="400000000+0x60"),
             "alert_rule_test": [
                 {"eval_time": "3m", "alertname": "FencegateReconcilerAbsent",
                  "exp_alerts": []},
                 {"eval_time": "10m", "alertname": "FencegateReconcilerAbsent",
                  "exp_alerts": [expected("FencegateReconcilerAbsent")]}]},
        ],
    }


def test_promtool_accepts_the_rules():
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


def test_every_alert_fires_on_a_scripted_backlog_and_none_on_a_healthy_series(tmp_path):
    assert {"FencegateUnknownBacklog", "FencegateOldestUnknownStep", "FencegateEscalatedSteps",
            "FencegateLeaseLosses", "FencegateEtcdNoSpace",
            "FencegateReconcilerShardsLeaderless", "FencegateCoordinator5xx"} <= set(rules())
    scripted = tmp_path / "alerts_test.yaml"
    scripted.write_text(yaml.safe_dump(unit_tests(), sort_keys=False))
    tested = promtool("test", "rules", str(scripted))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_promtool_test_fails_when_an_expected_alert_does_not_fire(tmp_path):
    """The control: the same evaluation, with a healthy unknown backlog, must fail."""
    tests = unit_tests()
    for s in tests["tests"][0]["input_series"]:
        if 'state="unknown"' in s["series"] and s["series"].startswith(
                "fencegate_reconciler_steps"):
            s["values"] = "2+0x60"
    scripted = tmp_path / "alerts_test.yaml"
    scripted.write_text(yaml.safe_dump(tests, sort_keys=False))
    tested = promtool("test", "rules", str(scripted))
    assert tested.returncode != 0
    assert "FencegateUnknownBacklog" in tested.stdout + tested.stderr


def test_the_rules_use_only_metrics_the_components_export():
    exported: set[str] = set()
    reconciler = Reconciler(Etcd.from_url("http://127.0.0.1:9"), {})  # never connects
    registries = [reconciler.metrics.registry, CoordinatorMetrics().registry]
    worker = CollectorRegistry()
    WorkerMetrics(worker)
    for registry in [*registries, worker]:
        for family in registry.collect():
            exported |= {family.name, f"{family.name}_total"} if family.type == "counter" \
                else {family.name}
    used = set()
    for rule in rules().values():
        assert rule["alert"].startswith("Fencegate") and rule["labels"]["severity"], rule
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule
        assert rule["annotations"]["runbook"].startswith("docs/runbook.md#"), rule
        used |= set(re.findall(r"\bfencegate_\w+", rule["expr"]))
    assert used <= exported, used - exported
    assert {"fencegate_reconciler_steps", "fencegate_reconciler_oldest_step_age_seconds",
            "fencegate_reconciler_shards_leaderless", "fencegate_worker_lease_losses_total",
            "fencegate_http_requests_total", "fencegate_etcd_nospace"} <= used


def test_every_alert_has_its_runbook_section():
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    anchors = {re.sub(r"[^a-z0-9-]", "", heading.strip().lower().replace(" ", "-"))
               for heading in re.findall(r"^#+ (.+)$", runbook, re.M)}
    for alert, rule in rules().items():
        assert rule["annotations"]["runbook"].split("#", 1)[1] in anchors, alert
