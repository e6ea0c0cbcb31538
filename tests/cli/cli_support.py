"""Helpers of the CLI and deploy tests: run ``python -m flexmarl.cli`` as a subprocess, job files."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil
import yaml

from flexmarl.cluster import LaunchError
from flexmarl.localcluster import CLUSTER_FILE, stop_from_file

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_JOB = REPO_ROOT / "examples" / "signaling" / "job.yaml"


@dataclasses.dataclass(frozen=True)
class CliResult:
    """Exit code and output of one CLI run."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def explain(self) -> str:
        return (f"flexmarl {' '.join(self.args)} -> {self.returncode}\n"
                f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}")


def run_cli(*args: str, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> CliResult:
    """Runs ``python -m flexmarl.cli ARGS`` from the repo root.

    Output goes to temp files, not pipes: `up --detach` leaves daemons behind that would
    otherwise hold a pipe open and block the read.
    """
    full_env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1", "NO_COLOR": "1",
                "TQDM_DISABLE": "1", **(env or {})}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run([sys.executable, "-m", "flexmarl.cli", *args], cwd=REPO_ROOT, env=full_env,
                              stdin=subprocess.DEVNULL, stdout=out, stderr=err, timeout=timeout_s, check=False)
        out.seek(0)
        err.seek(0)
        return CliResult(tuple(args), proc.returncode, out.read(), err.read())


def small_job(**overrides: Any) -> dict[str, Any]:
    """The signaling example shrunk to seconds: 2 steps of 4 tasks x 4 episodes, micro-batches of 8."""
    spec: dict[str, Any] = yaml.safe_load(EXAMPLE_JOB.read_text())
    spec["batch"] = {"prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8}
    spec["total_steps"] = 2
    spec.update(overrides)
    return spec


def write_job(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def cluster_processes(run_dir: Path) -> list[psutil.Process]:
    """etcd, every daemon of a local cluster and all their descendants (engine replicas)."""
    data = json.loads((run_dir / CLUSTER_FILE).read_text())
    pids = [int(d["pid"]) for d in data["daemons"].values()] + [int(data["etcd_pid"])]
    procs: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            procs.append(proc)
            procs.extend(proc.children(recursive=True))
    return procs


def gone(proc: psutil.Process) -> bool:
    """True when a process has exited (a zombie nobody reaped counts as exited)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def ensure_stopped(run_dir: Path) -> None:
    """Teardown safety net: stops a local cluster still recorded in run_dir, kills stragglers."""
    if not (run_dir / CLUSTER_FILE).exists():
        return
    procs = cluster_processes(run_dir)
    with contextlib.suppress(LaunchError):
        stop_from_file(run_dir, timeout_s=20)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if not gone(proc):
                proc.kill()


# ---------------------------------------------------------------- deploy/ helpers

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "flexmarl.json"
_METRIC_NAME = re.compile(r"\bflexmarl_[a-z0-9_]+")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the Grafana dashboard (panel targets and template variables)."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            queries.extend(t["expr"] for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            queries.append(query["query"])
    return queries


def dashboard_metric_names() -> set[str]:
    """The metric (sample) names the dashboard queries."""
    return {name for query in dashboard_queries() for name in _METRIC_NAME.findall(query)}


def family_names(sample_name: str) -> set[str]:
    """Family names a sample name can belong to (flexmarl_x_bucket -> {flexmarl_x_bucket, flexmarl_x})."""
    names = {sample_name}
    for suffix in _SUFFIXES:
        if sample_name.endswith(suffix):
            names.add(sample_name[: -len(suffix)])
    return names
