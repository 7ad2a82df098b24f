"""deploy/monitoring: the Grafana dashboard and the Prometheus alert rules, against the metrics spotrun exports.

* every PromQL expression of the dashboard and the rules names only metrics an agent exports
  (``elastic.metrics.AgentMetrics``, as scraped), and the dashboard is a well-formed Grafana dashboard;
* ``promtool check rules`` and ``promtool test rules`` (tests/deploy/monitoring/alerts_test.yml: each alert
  fires on the series that should fire it, not before its ``for:``);
* a real Prometheus (Debian's ``prometheus``, scrape interval 1 s, temporary storage, a free loopback port)
  scraping a real ``spotrun --standalone`` job of examples/train_ddp.py with ``--metrics-port``, queried through
  its HTTP API: the training step and the durable step advance, the checkpoint age is what the save cadence
  allows, every dashboard query and every rule evaluates without error.

Without promtool/prometheus the tests fail naming what is missing (``.ci/prometheus.sh`` installs Debian's
package; ``SPOTRUN_TEST_SKIP_PROMETHEUS=1`` skips them on purpose, saying so).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from checkpoint.api import step_dir
from elastic.metrics import AgentMetrics
from tests.harness.procs import SPOTRUN, Launcher, free_port, make_env, wait_for

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "dashboard.json"
ALERTS = MONITORING / "alerts.yml"
ALERT_TESTS = Path(__file__).parent / "monitoring" / "alerts_test.yml"
SKIP_ENV = "SPOTRUN_TEST_SKIP_PROMETHEUS"
_METRIC = re.compile(r"\bspotrun_[a-z0-9_]+")
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "5m", "$job": "spotrun", "$instance": ".*"}


_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created")}


def exported_names() -> set[str]:
    """Every sample name an agent can serve (counters' _total, histograms' _bucket/_sum/_count, labelled gauges
    not set yet included), from the families its registry declares."""
    return {family.name + suffix for family in AgentMetrics().registry.collect()
            for suffix in _SUFFIXES[family.type]}


def test_the_declared_names_are_the_served_ones() -> None:
    """``exported_names`` agrees with what a scrape serves (where the families have samples already)."""
    text = generate_latest(AgentMetrics().registry).decode()
    served = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert served <= exported_names() and "spotrun_restarts_total" in served


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard target."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def rule_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def tool(name: str) -> str:
    """The Debian binary ``name``, or the test fails naming it (skips only with SPOTRUN_TEST_SKIP_PROMETHEUS=1)."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: the Prometheus cases of deploy/monitoring did not run")
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `bash .ci/prometheus.sh` installs Debian's prometheus package (or "
                    f"set {SKIP_ENV}=1 to skip these cases on purpose)", pytrace=False)
    return path


def test_the_dashboard_is_a_grafana_dashboard_whose_panels_query_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "job", "instance"} <= variables
    names = exported_names()
    queries = dashboard_queries()
    assert len(queries) >= 15
    for panel in dash["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], f"panel {panel['title']!r} has no query"
            assert {t["refId"] for t in panel["targets"]} == {chr(65 + i) for i in range(len(panel["targets"]))}
    for title, expr in queries:
        used = set(_METRIC.findall(expr))
        assert used, f"panel {title!r}: {expr!r} names no spotrun metric"
        assert used <= names, f"panel {title!r} queries {sorted(used - names)}, which no agent exports"
    # the dashboard shows what the issue asks an operator to see
    shown = {m for _, expr in queries for m in _METRIC.findall(expr)}
    assert {"spotrun_training_step", "spotrun_steps_per_second", "spotrun_checkpoint_durable_age_seconds",
            "spotrun_memory_snapshot_age_seconds", "spotrun_checkpoint_saves_total", "spotrun_restores_total",
            "spotrun_restarts_total", "spotrun_stragglers"} <= shown


def test_every_alert_rule_names_exported_metrics() -> None:
    names = exported_names()
    rules = rule_queries()
    assert {a for a, _ in rules} == {"SpotrunJobNotProgressing", "SpotrunRestartsFrequent", "SpotrunCheckpointStale",
                                     "SpotrunCheckpointSavesFailing", "SpotrunEtcdOutage", "SpotrunStraggler"}
    for alert, expr in rules:
        used = set(_METRIC.findall(expr))
        assert used and used <= names, f"{alert} queries {sorted(used - names)}, which no agent exports"


def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    promtool = tool("promtool")
    check = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 6 rules found" in check.stdout
    tests = subprocess.run([promtool, "test", "rules", str(ALERT_TESTS)], capture_output=True, text=True, timeout=60)
    assert tests.returncode == 0, tests.stdout + tests.stderr


# --- a real Prometheus scraping a real job ------------------------------------------------------------------


class Prometheus:
    """Debian's prometheus on a free loopback port, scraping ``targets`` every second, storage in ``work``."""

    def __init__(self, binary: str, work: Path, targets: list[str]) -> None:
        self.port = free_port()
        rules = work / "alerts.yml"
        shutil.copy(ALERTS, rules)
        config = work / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": "spotrun", "static_configs": [{"targets": targets}]}],
        }))
        self.log = work / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:  # a bad query: 400 with the error in the body
            body = json.load(exc)
        return body

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = self.api("query", query=expr)
        assert body["status"] == "success", f"{expr}: {body}"
        return list(body["data"]["result"])

    def value(self, expr: str) -> float | None:
        try:
            result = self.query(expr)
        except OSError:
            return None
        return float(result[0]["value"][1]) if result else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def prometheus_binary() -> str:
    return tool("prometheus")


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[Launcher, int, Path]]:
    """examples/train_ddp.py under spotrun --standalone, 2 workers, a commit every 20 steps of ~0.1 s."""
    port = free_port()
    ckpt = tmp_path / "ckpt"
    agent = Launcher([*SPOTRUN, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1",
                      "--metrics-port", str(port), "--events-file", str(tmp_path / "events.jsonl"),
                      str(ROOT / "examples" / "train_ddp.py"), "--steps", "100000", "--step-time", "0.05",
                      "--ckpt-every", "20", "--ckpt-dir", str(ckpt), "--log-every", "100"],
                     tmp_path / "agent.log", make_env())
    try:
        yield agent, port, ckpt
    finally:
        agent.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_prometheus_sees_a_real_job_progress_and_its_checkpoints_age(
        prometheus_binary: str, job: tuple[Launcher, int, Path], tmp_path: Path) -> None:
    agent, port, ckpt = job
    work = tmp_path / "prom"
    work.mkdir()
    prom = Prometheus(prometheus_binary, work, [f"127.0.0.1:{port}"])
    try:
        def context() -> str:
            return f"\n--- agent ---\n{agent.output()[-3000:]}\n--- prometheus ---\n{prom.log.read_text()[-2000:]}"

        first = wait_for(lambda: prom.value("spotrun_checkpoint_durable_step"), 120,
                         "a durable commit scraped by Prometheus" + context())
        step_1 = prom.value("spotrun_training_step")
        steps_1 = prom.value("spotrun_training_steps_total")
        assert step_1 is not None and steps_1 is not None
        # Progress: both the reported step and the steps counter advance, and so does the durable step.
        wait_for(lambda: (v := prom.value("spotrun_checkpoint_durable_step")) is not None and v >= first + 40, 90,
                 "two more commits scraped" + context())
        step_2, steps_2 = prom.value("spotrun_training_step"), prom.value("spotrun_training_steps_total")
        assert step_2 is not None and steps_2 is not None and step_2 > step_1 and steps_2 > steps_1
        rate = prom.value("rate(spotrun_training_steps_total[10s])")
        assert rate is not None and rate > 1, rate
        # The checkpoint age is right: a commit every 20 steps at ~10 steps/s, so never much older than the
        # interval between commits (plus one metrics tick and one scrape); and it matches the timestamp.
        interval = prom.value("spotrun_checkpoint_save_interval_seconds")
        age = prom.value("spotrun_checkpoint_durable_age_seconds")
        assert interval is not None and 0.5 < interval < 20, interval
        assert age is not None and 0 <= age <= interval * 3 + 3, (age, interval)
        skew = prom.value("abs(time() - spotrun_checkpoint_durable_timestamp_seconds - "
                          "spotrun_checkpoint_durable_age_seconds)")
        assert skew is not None and skew < 3, skew
        durable = prom.value("spotrun_checkpoint_durable_step")
        assert durable is not None and durable % 20 == 0 and (ckpt / step_dir(int(durable))).is_dir(), durable
        assert prom.value('spotrun_checkpoint_saves_total{outcome="failed"}') == 0  # present at 0
        assert prom.value('spotrun_restarts_total{cause="failure"}') == 0
        # Every dashboard query and every rule evaluates (PromQL valid against the real server).
        for title, expr in dashboard_queries():
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert prom.api("query", query=expr)["status"] == "success", f"panel {title!r}: {expr}"
        rules = prom.api("rules")["data"]["groups"][0]["rules"]
        assert len(rules) == 6 and all(r["health"] in ("ok", "unknown") for r in rules), rules
        assert not [r["name"] for r in rules if r["state"] == "firing"], rules  # a healthy job fires nothing
    finally:
        prom.close()
