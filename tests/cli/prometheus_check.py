"""A real Prometheus (Debian's ``prometheus`` package) scraping a cluster the way deploy/ sets it up.

deploy/prometheus/etcd_sd.py writes the file_sd targets from etcd; Prometheus runs with
deploy/prometheus/prometheus.yml's ``flexmarl`` scrape job (its relabelling included), pointed at
that file and scraping every second; every PromQL query of deploy/grafana/flexmarl.json is then
evaluated through Prometheus's HTTP API.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from cli_support import REPO_ROOT, dashboard_queries

from flexmarl.cluster import free_port, wait_until

PROMETHEUS_BINARY = shutil.which("prometheus") or "/usr/bin/prometheus"
SCRAPE_INTERVAL_S = 1.0
#: Dashboard template variables ($job, $agent) and the [$__rate_interval] Grafana fills in.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1s", "$job": ".*", "$agent": ".*",
                     "$kind": ".*", "$instance": ".*"}


def write_targets(etcd_endpoint: str, out: Path) -> None:
    """deploy/prometheus/etcd_sd.py in one-shot mode."""
    done = subprocess.run([sys.executable, str(REPO_ROOT / "deploy" / "prometheus" / "etcd_sd.py"),
                           "--etcd-endpoints", etcd_endpoint, "--out", str(out)],
                          capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"etcd_sd.py -> {done.returncode}: {done.stderr}")


def prometheus_config(targets: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml's flexmarl job, reading ``targets`` and scraping every second."""
    deployed = yaml.safe_load((REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in deployed["scrape_configs"] if j["job_name"] == "flexmarl")
    job["scrape_interval"] = f"{SCRAPE_INTERVAL_S:g}s"
    job["file_sd_configs"] = [{"files": [str(targets)], "refresh_interval": "1s"}]
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": [job]}


@contextlib.contextmanager
def prometheus(etcd_endpoint: str, work_dir: Path) -> Iterator[str]:
    """A started Prometheus scraping the cluster's daemons; yields its base URL."""
    work_dir.mkdir(parents=True, exist_ok=True)
    targets = work_dir / "targets.json"
    write_targets(etcd_endpoint, targets)
    config = work_dir / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(targets)))
    port = free_port()
    log = (work_dir / "prometheus.log").open("wb")
    proc = subprocess.Popen([PROMETHEUS_BINARY, f"--config.file={config}", f"--storage.tsdb.path={work_dir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url, proc), 30, "prometheus to become ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _ready(url: str, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"prometheus exited with code {proc.returncode}")
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def _get(url: str, path: str, **params: str) -> Any:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(params)}", timeout=10) as reply:
        body = json.loads(reply.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body}")
    return body["data"]


def healthy_targets(url: str) -> dict[str, str]:
    """service_id (the relabelled ``instance``) -> health of each active target."""
    active = _get(url, "/api/v1/targets", state="active")["activeTargets"]
    return {t["labels"]["instance"]: t["health"] for t in active}


def expand(query: str) -> str:
    """A dashboard query with Grafana's variables filled in."""
    for name, value in sorted(GRAFANA_VARIABLES.items(), key=lambda item: -len(item[0])):
        query = query.replace(name, value)
    return query


def query(url: str, promql: str) -> list[dict[str, Any]]:
    """An instant query's result vector."""
    result: list[dict[str, Any]] = _get(url, "/api/v1/query", query=promql)["result"]
    return result


_LABEL_VALUES = re.compile(r"^label_values\((?P<metric>[^,]+),\s*(?P<label>\w+)\)$")


def evaluate(url: str, dashboard_query: str) -> list[Any]:
    """A dashboard query through the HTTP API: PromQL by /api/v1/query, Grafana's
    ``label_values(metric, label)`` (a template variable) by /api/v1/label/<label>/values."""
    variable = _LABEL_VALUES.match(dashboard_query)
    if variable is not None:
        values: list[Any] = _get(url, f"/api/v1/label/{variable['label']}/values",
                                 **{"match[]": variable["metric"].strip()})
        return values
    return query(url, expand(dashboard_query))


def empty_dashboard_queries(url: str) -> list[str]:
    """The dashboard's queries that return nothing (each expanded as Grafana would)."""
    return [q for q in dashboard_queries() if not evaluate(url, q)]


def wait_for_scrapes(url: str, services: int, scrapes: int = 3, timeout_s: float = 60.0) -> None:
    """Until every target is up and has been scraped ``scrapes`` times (rate() needs two samples)."""
    wait_until(lambda: list(healthy_targets(url).values()).count("up") >= services, timeout_s,
               f"{services} healthy targets")
    time.sleep(scrapes * SCRAPE_INTERVAL_S)


def ask_trainer_status(etcd_endpoint: str) -> None:
    """One GetTrainerStatus call to a registered traind, as an operator's tool makes.

    traind's only RPC; nothing in a job calls it, so without one call the dashboard's two traind
    RPC panels (requests and latency by method) have no series at all.
    """
    import asyncio

    import grpc

    from flexmarl.client import discover
    from flexmarl.v1 import train_pb2, train_pb2_grpc

    address = asyncio.run(discover("traind", etcd_endpoint))
    with grpc.insecure_channel(address) as channel:
        train_pb2_grpc.TrainerStub(channel).GetTrainerStatus(train_pb2.GetTrainerStatusRequest(), timeout=10)


def assert_dashboard_has_data(etcd_endpoint: str, work_dir: Path, services: int = 4) -> None:
    """Prometheus scrapes every daemon of the cluster through the etcd file_sd, and every dashboard query has data."""
    ask_trainer_status(etcd_endpoint)
    with prometheus(etcd_endpoint, work_dir) as url:
        wait_for_scrapes(url, services)
        assert sorted(healthy_targets(url).values()) == ["up"] * services, healthy_targets(url)
        empty = empty_dashboard_queries(url)
        assert not empty, "dashboard queries without data in Prometheus:\n" + "\n".join(empty)
