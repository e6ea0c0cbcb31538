"""deploy/: systemd units (systemd-analyze verify), example configs, Prometheus file_sd (promtool), Grafana dashboard,
the shell scripts (shellcheck), each file checked as shipped by its own tool."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import REPO_ROOT, dashboard_metric_names, dashboard_queries, family_names
from prometheus_client import CollectorRegistry, Gauge

from flexmarl.cluster import EtcdServer
from flexmarl.config import DaemonConfig, load_config
from flexmarl.metrics import RpcMetrics
from flexmarl.registry import Registry, ServiceRecord
from orchestratord.config import OrchestratorConfig
from orchestratord.metrics import OrchestratorMetrics
from rolloutd.config import RolloutConfig
from rolloutd.metrics import RolloutMetrics
from stored.blobs import BlobStore
from stored.config import StoredConfig
from stored.database import Database
from stored.experiences import ExperienceStore
from stored.metrics import StoredMetrics
from traind.config import TrainerConfig
from traind.metrics import TrainerMetrics

DEPLOY = REPO_ROOT / "deploy"
UNITS = DEPLOY / "systemd"
DAEMON_KINDS = ("stored", "orchestratord", "traind", "rolloutd")
#: Where the units expect the console scripts (docs/deploy.md installs the venv there).
INSTALLED_BIN = "/opt/flexmarl/venv/bin/"
CONFIG_CLASSES: dict[str, type[DaemonConfig]] = {
    "stored": StoredConfig, "orchestratord": OrchestratorConfig, "traind": TrainerConfig, "rolloutd": RolloutConfig,
}


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((UNITS / name).read_text())
    return parser


# ---------------------------------------------------------------- systemd


def test_units_exist_for_every_daemon_etcd_and_the_target() -> None:
    names = {p.name for p in UNITS.iterdir()}
    expected = {f"flexmarl-{kind}@.service" for kind in (*DAEMON_KINDS, "etcd", "prometheus-sd")}
    assert expected | {"flexmarl.target"} <= names


@pytest.mark.parametrize("kind", DAEMON_KINDS)
def test_daemon_unit_runs_the_console_script_with_a_per_instance_config(kind: str) -> None:
    service = _unit(f"flexmarl-{kind}@.service")["Service"]
    exec_start = service["ExecStart"]
    assert exec_start.startswith(f"{INSTALLED_BIN}{kind} --config-file /etc/flexmarl/%i/{kind}.yaml")
    assert service["EnvironmentFile"] == "-/etc/flexmarl/%i.env"
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == "2"  # bad config: do not restart in a loop
    assert service["KillSignal"] == "SIGTERM"
    for key, value in {"ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
                       "NoNewPrivileges": "yes", "User": "flexmarl"}.items():
        assert service[key] == value, key
    assert service["StateDirectory"] == f"flexmarl/%i/{kind}"
    if kind != "orchestratord":  # orchestratord keeps its state in etcd
        assert f"--{'data' if kind == 'stored' else 'work'}-dir %S/flexmarl/%i/{kind}" in exec_start


@pytest.mark.parametrize("kind", DAEMON_KINDS)
def test_stop_timeout_exceeds_the_drain_grace_of_the_example_config(kind: str) -> None:
    timeout = _unit(f"flexmarl-{kind}@.service")["Service"]["TimeoutStopSec"]
    assert timeout.endswith("s")
    config = load_config(CONFIG_CLASSES[kind], ["--config-file", str(DEPLOY / "config" / f"{kind}.yaml")], kind,
                         env={})
    assert float(timeout[:-1]) >= 2 * config.grace_s


@pytest.mark.parametrize("kind", DAEMON_KINDS)
def test_example_config_files_load(kind: str) -> None:
    """Every key of deploy/config/<kind>.yaml is a real setting and passes validation, env file included."""
    env = {}
    for line in (DEPLOY / "config" / "cluster.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    config = load_config(CONFIG_CLASSES[kind], ["--config-file", str(DEPLOY / "config" / f"{kind}.yaml")], kind,
                         env=env)
    assert config.host == "0.0.0.0" and config.metrics_host == "0.0.0.0" and config.metrics_port > 0
    assert config.advertise_host == env["FLEXMARL_ADVERTISE_HOST"]
    assert config.etcd_endpoints == env["FLEXMARL_ETCD_ENDPOINTS"]


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` of every unit, with ExecStart pointed at this environment's scripts."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (Debian package `systemd`)")
    scripts = Path(sys.executable).parent
    for kind in DAEMON_KINDS:
        if not (scripts / kind).exists():
            pytest.skip(f"console script {kind} not installed next to {sys.executable} (pip install -e .)")
    # The units reference /opt/flexmarl/venv/bin/<script>, which verify requires to exist and be
    # executable; install copies of the units that point at this interpreter's scripts instead.
    for path in UNITS.iterdir():
        text = path.read_text().replace(INSTALLED_BIN, f"{scripts}/")
        text = text.replace("/opt/flexmarl/deploy/", f"{REPO_ROOT}/deploy/")
        (tmp_path / path.name).write_text(text)
    instances = ["flexmarl.target"] + [f"flexmarl-{k}@prod.service" for k in (*DAEMON_KINDS, "etcd", "prometheus-sd")]
    done = subprocess.run([analyze, "verify", "--man=no", "--recursive-errors=no", *instances], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    ours = [line for line in (done.stdout + done.stderr).splitlines() if "flexmarl" in line]
    assert done.returncode == 0 and not ours, done.stdout + done.stderr


def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The verify test above can fail: a missing executable and an unknown key are reported."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (Debian package `systemd`)")
    text = (UNITS / "flexmarl-stored@.service").read_text().replace("KillSignal=", "KillSignall=")
    (tmp_path / "flexmarl-stored@.service").write_text(text)
    (tmp_path / "flexmarl.target").write_text((UNITS / "flexmarl.target").read_text())
    done = subprocess.run([analyze, "verify", "--man=no", "--recursive-errors=no", "flexmarl-stored@prod.service"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "is not executable" in output and "Unknown key 'KillSignall'" in output


def _tool(name: str) -> str:
    """The path of a checking tool; in CI (CI=true) a missing one fails the test, elsewhere it skips."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} not installed (./dev.sh setup installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


# ---------------------------------------------------------------- shell scripts


def _shell_scripts() -> list[Path]:
    """Every shell script in deploy/ (by suffix or shebang), the README's dev.sh and CI's entry point."""
    found = [REPO_ROOT / "dev.sh", REPO_ROOT / ".ci" / "run"]
    shells = (b"#!/usr/bin/env bash", b"#!/usr/bin/env sh", b"#!/bin/bash", b"#!/bin/sh")
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and (path.suffix in (".sh", ".sbatch") or path.read_bytes().startswith(shells)):
            found.append(path)
    return found


def test_shellcheck_passes_every_shell_script_as_shipped(tmp_path: Path) -> None:
    shellcheck = _tool("shellcheck")
    scripts = _shell_scripts()
    assert DEPLOY / "slurm" / "flexmarl.sbatch" in scripts
    done = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # The check can fail: an unquoted expansion is reported.
    broken = tmp_path / "broken.sh"
    broken.write_text("#!/usr/bin/env bash\nrm -rf $1/data\n")
    done = subprocess.run([shellcheck, str(broken)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and "SC2086" in done.stdout


# ---------------------------------------------------------------- Prometheus


def test_promtool_accepts_the_prometheus_config_as_shipped(tmp_path: Path) -> None:
    """Debian's promtool on deploy/prometheus/prometheus.yml itself (the Prometheus test rewrites its paths)."""
    promtool = _tool("promtool")
    shipped = DEPLOY / "prometheus" / "prometheus.yml"
    done = subprocess.run([promtool, "check", "config", str(shipped)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0 and "SUCCESS" in done.stdout + done.stderr, done.stdout + done.stderr
    # The check can fail: a glob in a directory of a file_sd path (what shipped until 2026-12-05) is refused.
    broken = tmp_path / "prometheus.yml"
    broken.write_text(shipped.read_text().replace("/var/lib/flexmarl-sd/*.json", "/var/lib/flexmarl-sd/*/targets.json"))
    done = subprocess.run([promtool, "check", "config", str(broken)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode != 0 and "is not valid for file discovery" in done.stdout + done.stderr


def _run_sd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(DEPLOY / "prometheus" / "etcd_sd.py"), *args],
                          capture_output=True, text=True, timeout=60, check=False)


async def test_etcd_sd_writes_one_target_per_daemon_with_metrics(etcd: EtcdServer, tmp_path: Path) -> None:
    registry = Registry(etcd.endpoint, "/flexmarl-sd-test")
    await registry.connect()
    try:
        records = [
            ServiceRecord("stored", "stored-a", "10.0.0.5:50052", 9402, 11, 1),
            ServiceRecord("traind", "traind-gpu3", "gpu3.example:50053", 9403, 12, 1),
            ServiceRecord("rolloutd", "rolloutd-x", "infer1.example:50054", -1, 13, 1),  # metrics off
        ]
        for record in records:
            await registry.register(record, ttl_s=30)
        out = tmp_path / "sd" / "targets.json"
        done = _run_sd("--etcd-endpoints", etcd.endpoint, "--etcd-prefix", "/flexmarl-sd-test", "--out", str(out))
        assert done.returncode == 0, done.stderr
        assert json.loads(out.read_text()) == [
            {"targets": ["10.0.0.5:9402"],
             "labels": {"kind": "stored", "service_id": "stored-a", "flexmarl_cluster": "/flexmarl-sd-test"}},
            {"targets": ["gpu3.example:9403"],
             "labels": {"kind": "traind", "service_id": "traind-gpu3", "flexmarl_cluster": "/flexmarl-sd-test"}},
        ]
        # a daemon that leaves disappears from the next file
        await registry.deregister("traind", "traind-gpu3")
        assert _run_sd("--etcd-endpoints", etcd.endpoint, "--etcd-prefix", "/flexmarl-sd-test",
                       "--out", str(out)).returncode == 0
        assert [g["labels"]["service_id"] for g in json.loads(out.read_text())] == ["stored-a"]
        assert [p.name for p in out.parent.iterdir()] == ["targets.json"]  # no temp file left behind
    finally:
        for record in records:
            await registry.deregister(record.kind, record.service_id)
        await registry.close()


def test_etcd_sd_unreachable_etcd_is_exit_1_and_bad_endpoint_exit_2(tmp_path: Path) -> None:
    done = _run_sd("--etcd-endpoints", "127.0.0.1:1", "--timeout-s", "1", "--out", str(tmp_path / "t.json"))
    assert done.returncode == 1 and done.stderr.startswith("etcd_sd: etcd unreachable"), done.stderr
    assert not (tmp_path / "t.json").exists()
    done = _run_sd("--etcd-endpoints", "no-port", "--out", str(tmp_path / "t.json"))
    assert done.returncode == 2 and "is not host:port" in done.stderr


def test_prometheus_config_reads_the_sd_file_the_sd_unit_writes() -> None:
    import yaml

    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "flexmarl")
    pattern = job["file_sd_configs"][0]["files"][0]
    exec_start = _unit("flexmarl-prometheus-sd@.service")["Service"]["ExecStart"]
    written = exec_start.split("--out ")[1].split()[0].replace("%S", "/var/lib").replace("%i", "prod")
    assert Path(written).match(pattern)


# ---------------------------------------------------------------- Grafana


def registered_metric_names(tmp_path: Path) -> set[str]:
    """Family and sample names of every metric the daemons register (each metrics class instantiated)."""
    registry = CollectorRegistry()
    for kind in DAEMON_KINDS:
        RpcMetrics(kind, registry)
        # flexmarl.daemon.DaemonRunner registers this one next to the RPC metrics.
        Gauge(f"flexmarl_{kind}_up", "1 while the daemon serves.", registry=registry)
    OrchestratorMetrics(registry)
    RolloutMetrics(registry)
    TrainerMetrics(registry)
    db = Database(tmp_path / "stored.db")
    try:
        stored = StoredMetrics(registry)
        stored.watch_contents(ExperienceStore(db), BlobStore(db, tmp_path / "blobs"))
        names: set[str] = set()
        for family in registry.collect():
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(family.type, ())
            names.update(family.name + suffix for suffix in suffixes)
    finally:
        db.close()
    return names


def test_every_dashboard_metric_is_registered_by_a_daemon(tmp_path: Path) -> None:
    queried = dashboard_metric_names()
    assert len(queried) >= 30
    registered = registered_metric_names(tmp_path)
    assert sorted(name for name in queried if name not in registered) == []


def test_dashboard_covers_the_design_metrics() -> None:
    queried = dashboard_metric_names()
    for needed in ("flexmarl_rolloutd_generated_tokens_total", "flexmarl_rolloutd_task_seconds_bucket",
                   "flexmarl_rolloutd_weight_reload_seconds_bucket", "flexmarl_traind_slot_busy_fraction",
                   "flexmarl_traind_swap_seconds_count", "flexmarl_traind_step_seconds_bucket",
                   "flexmarl_orchestratord_steps_committed_total", "flexmarl_stored_experience_rows",
                   "flexmarl_stored_experience_bytes", "flexmarl_stored_rpc_requests_total",
                   "flexmarl_orchestratord_rpc_seconds_bucket"):
        assert needed in queried, needed
    for name in queried:  # histograms are queried through their buckets/count/sum, never bare
        assert family_names(name) != {name} or not name.endswith("_seconds"), name


def test_dashboard_json_is_well_formed() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "flexmarl.json").read_text())
    assert dashboard["uid"] == "flexmarl" and dashboard["title"] == "FlexMARL"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "agent"} <= variables
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    for query in dashboard_queries():
        assert query.count("(") == query.count(")") and query.count("{") == query.count("}"), query
        assert "rate(" not in query or "[$__rate_interval]" in query, query
