"""Every `flexmarl` subcommand against a real local cluster (`flexmarl up --detach`), as a subprocess.

One cluster serves the whole module; the last test takes it down with `flexmarl down`.
"""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from cli_support import (
    REPO_ROOT,
    CliResult,
    cluster_processes,
    dashboard_metric_names,
    ensure_stopped,
    family_names,
    gone,
    run_cli,
    small_job,
    write_job,
)

from flexmarl.client import Client
from flexmarl.localcluster import CLUSTER_FILE, wipe_state

pytestmark = pytest.mark.timeout(300)

DAEMONS = ("stored", "orchestratord", "traind-0", "rolloutd-0")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A detached local cluster (1 rollout worker with 1 replica, 1 trainer); always taken down."""
    path = tmp_path_factory.mktemp("cluster")
    try:
        up = run_cli("up", "--detach", "--run-dir", str(path), "--engine-replicas", "1", timeout_s=180)
        assert up.returncode == 0, up.explain()
        yield path
    finally:
        if (path / CLUSTER_FILE).exists():
            run_cli("down", "--run-dir", str(path), timeout_s=120)
        ensure_stopped(path)
        wipe_state(path)  # `flexmarl down` keeps etcd's data (~60 MB preallocated): leave none behind


@pytest.fixture(scope="module")
def etcd_endpoint(run_dir: Path) -> str:
    return str(json.loads((run_dir / CLUSTER_FILE).read_text())["etcd_endpoint"])


def job_names(etcd_endpoint: str) -> list[str]:
    with Client(etcd_endpoints=etcd_endpoint) as client:
        return sorted(job.job_id for job in client.list_jobs())


@pytest.fixture(scope="module")
def finished_job(run_dir: Path, small_job_file: Path) -> tuple[str, CliResult]:
    """A 2-step signaling job submitted with `flexmarl submit` and followed with `flexmarl watch`."""
    submitted = run_cli("submit", str(small_job_file), "--run-dir", str(run_dir), timeout_s=120)
    assert submitted.returncode == 0, submitted.explain()
    job_id = submitted.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", job_id), submitted.explain()
    watched = run_cli("watch", job_id, "--run-dir", str(run_dir), timeout_s=240)
    return job_id, watched


def test_up_writes_cluster_file_and_jobs_lists_no_job(run_dir: Path) -> None:
    data = json.loads((run_dir / CLUSTER_FILE).read_text())
    assert set(data["daemons"]) == set(DAEMONS)
    for name in DAEMONS:
        assert psutil.pid_exists(data["daemons"][name]["pid"]), name
        assert (run_dir / f"{name}.log").exists()
    jobs = run_cli("jobs", "--run-dir", str(run_dir))
    assert jobs.returncode == 0, jobs.explain()
    assert re.search(r"job\s*\S\s*name\s*\S\s*state", jobs.stdout), jobs.explain()


def test_watch_follows_the_job_until_it_succeeds(finished_job: tuple[str, CliResult]) -> None:
    job_id, watched = finished_job
    assert watched.returncode == 0, watched.explain()
    assert f"job {job_id}" in watched.stdout and "succeeded" in watched.stdout, watched.explain()
    for agent in ("sender", "receiver"):
        assert re.search(rf"{agent}\s*\S\s*2/2", watched.stdout), watched.explain()


def test_status_json_and_table(run_dir: Path, finished_job: tuple[str, CliResult]) -> None:
    job_id, _ = finished_job
    as_json = run_cli("status", job_id, "--json", "--run-dir", str(run_dir))
    assert as_json.returncode == 0, as_json.explain()
    status = json.loads(as_json.stdout)
    assert status["job_id"] == job_id and status["state"] == "SUCCEEDED" and status["error"] == ""
    agents = {a["agent"]: a for a in status["agents"]}
    assert set(agents) == {"sender", "receiver"}
    for agent in agents.values():
        assert agent["step"] == agent["total_steps"] == agent["version"] == 2
        assert agent["weights_uri"]

    table = run_cli("status", job_id, "--run-dir", str(run_dir))
    assert table.returncode == 0, table.explain()
    assert f"job {job_id} (signaling): succeeded  tasks 8/8" in table.stdout, table.explain()


def test_time_to_reward_reads_the_jobs_own_steps(run_dir: Path, finished_job: tuple[str, CliResult]) -> None:
    job_id, _ = finished_job
    history = run_cli("history", job_id, "--csv", "--run-dir", str(run_dir))
    rows = list(csv.DictReader(io.StringIO(history.stdout)))
    first = sum(float(r["return_mean"]) for r in rows if r["step"] == "0") / 2
    result = run_cli("time-to-reward", job_id, job_id, "--window", "1", "--target", str(first), "--json",
                     "--run-dir", str(run_dir))
    assert result.returncode == 0, result.explain()
    out = json.loads(result.stdout)
    assert out["target"] == first and len(out["jobs"]) == 2
    job = out["jobs"][0]
    # reached at step 0, the moment its first step committed: 0 s after step 0, a few seconds after submission
    assert (job["job_id"], job["state"], job["points"], job["reached_at"]) == (job_id, "succeeded", 2, 0)
    assert job["after_step0_s"] == 0.0 and job["since_submit_s"] > 0 and job["speedup"] is None
    # a 5-step moving mean over 2 steps has no value yet: nothing reached, said as such
    table = run_cli("time-to-reward", job_id, "--target", "0", "--run-dir", str(run_dir))
    assert table.returncode == 0 and "target 0.000" in table.stdout and "-" in table.stdout, table.explain()


def test_history_status_and_watch_show_the_reported_return_beside_the_trained_reward(
        run_dir: Path, finished_job: tuple[str, CliResult]) -> None:
    """The example's sender trains on the receiver's probability of the target (shape_reward); both report 0/1."""
    job_id, watched = finished_job
    history = run_cli("history", job_id, "--csv", "--run-dir", str(run_dir))
    assert history.returncode == 0, history.explain()
    rows = {(r["agent"], int(r["step"])): r for r in csv.DictReader(io.StringIO(history.stdout))}
    assert sorted(rows) == [("receiver", 0), ("receiver", 1), ("sender", 0), ("sender", 1)], history.explain()
    for step in (0, 1):
        sender, receiver = rows[("sender", step)], rows[("receiver", step)]
        episodes = int(sender["episodes"])
        assert episodes == int(receiver["episodes"]) == 16
        # the same episodes' shared 0/1 success, reported unshaped for both agents
        assert float(sender["return_mean"]) == float(receiver["return_mean"])
        assert (float(receiver["return_mean"]) * episodes).is_integer()
        # the receiver trains on that success; the sender on a probability, so its trained mean is another number
        assert float(receiver["reward_mean"]) == float(receiver["return_mean"])
        assert float(sender["reward_mean"]) != float(sender["return_mean"]), history.explain()

    status = run_cli("status", job_id, "--json", "--run-dir", str(run_dir))
    assert status.returncode == 0, status.explain()
    agents = {a["agent"]: a for a in json.loads(status.stdout)["agents"]}
    for agent, progress in agents.items():  # the last step's two means, under their own names
        assert progress["return_mean"] == float(rows[(agent, 1)]["return_mean"]), status.explain()
        assert progress["reward_mean"] == float(rows[(agent, 1)]["reward_mean"]), status.explain()
    sender = agents["sender"]
    watch_line = (f"{job_id} sender step 2/2 v2 return {sender['return_mean']:.3f} "
                  f"trained_reward {sender['reward_mean']:.3f} ")
    assert watch_line in watched.stdout, watched.explain()
    table = run_cli("status", job_id, "--run-dir", str(run_dir))
    assert re.search(r"return\s*\S\s*trained reward", table.stdout), table.explain()
    assert re.search(rf"sender\s*\S\s*2/2\s*\S\s*2\s*\S\s*{sender['return_mean']:.3f}\s*\S\s*"
                     rf"{sender['reward_mean']:.3f}", table.stdout), table.explain()


def test_jobs_lists_the_finished_job(run_dir: Path, finished_job: tuple[str, CliResult]) -> None:
    job_id, _ = finished_job
    jobs = run_cli("jobs", "--run-dir", str(run_dir))
    assert jobs.returncode == 0, jobs.explain()
    line = next((ln for ln in jobs.stdout.splitlines() if job_id in ln), "")
    assert "succeeded" in line and "sender 2/2" in line and "8/8" in line, jobs.explain()


def test_plot_writes_a_png(run_dir: Path, finished_job: tuple[str, CliResult], tmp_path: Path) -> None:
    job_id, _ = finished_job
    out = tmp_path / "curves.png"
    plotted = run_cli("plot", job_id, "--out", str(out), "--run-dir", str(run_dir), timeout_s=120)
    assert plotted.returncode == 0, plotted.explain()
    assert plotted.stdout.strip() == str(out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # two panels with axes, curves and legends, not an empty canvas


def test_cancel_a_running_job(run_dir: Path, etcd_endpoint: str, tmp_path: Path) -> None:
    long_job = write_job(tmp_path / "long.yaml", small_job(name="long", total_steps=500))
    submitted = run_cli("submit", str(long_job), "--run-dir", str(run_dir), timeout_s=120)
    assert submitted.returncode == 0, submitted.explain()
    job_id = submitted.stdout.strip().splitlines()[-1]

    cancelled = run_cli("cancel", job_id, "--run-dir", str(run_dir))
    assert cancelled.returncode == 0, cancelled.explain()
    assert cancelled.stdout.strip() == f"{job_id}: cancelled"

    with Client(etcd_endpoints=etcd_endpoint) as client:
        assert client.status(job_id).state.name == "CANCELLED"
    # watch of a cancelled job ends at once with exit code 1 (the job did not succeed)
    watched = run_cli("watch", job_id, "--run-dir", str(run_dir))
    assert watched.returncode == 1, watched.explain()
    assert "cancelled" in watched.stdout


def test_a_job_whose_environment_does_not_load_fails_once_and_watch_says_why(run_dir: Path, tmp_path: Path) -> None:
    spec = small_job(name="typo")
    spec["environment"]["entrypoint"] = "examples.signalling.env:SignalingGame"  # a typo in the module
    job = write_job(tmp_path / "typo.yaml", spec)
    # --no-preflight: the daemons find it (the CLI's own check is tested in test_cli_submit_checks.py).
    result = run_cli("submit", str(job), "--no-preflight", "--watch", "--run-dir", str(run_dir), timeout_s=120)
    assert result.returncode == 1, result.explain()
    job_id = result.stdout.strip().splitlines()[0]
    lines = [line for line in result.stderr.splitlines() if job_id in line]
    assert lines and "FAILED" in lines[-1] and "examples.signalling.env" in lines[-1], result.explain()
    assert "failed 5 times" not in result.stderr  # the first attempt fails the job


def test_unknown_job_is_exit_1_with_one_line(run_dir: Path) -> None:
    for command in ("status", "cancel", "plot"):
        result = run_cli(command, "no-such-job", "--run-dir", str(run_dir))
        assert result.returncode == 1, result.explain()
        assert result.stderr.strip() == f"flexmarl {command}: job 'no-such-job' not found", result.explain()


def _broken(tmp: Path, name: str) -> tuple[Path, str]:
    """A broken job file and a regex its one-line error must match (field and reason)."""
    spec = small_job(name=f"broken-{name}")
    if name == "unknown-field":
        spec["batch"]["rollouts_per_prompt"] = 4
        expected = r"batch\.rollouts_per_prompt: unknown field"
    elif name == "micro-batch":
        spec["batch"]["micro_batch_size"] = 6
        expected = r"batch\.micro_batch_size: must be a multiple of batch\.group_size \(4\), got 6"
    elif name == "agent-name":
        spec["agents"][1]["name"] = "Receiver 2"
        expected = r"agents\[1\]\.name: must match .*got 'Receiver 2'"
    elif name == "tiny-parameter":
        spec["agents"][0]["model"] = "tiny://qwen2?seed=1&layers=3"
        expected = r"agents\[sender\]\.model: unknown tiny:// parameter 'layers'"
    elif name == "tiny-value":
        spec["agents"][0]["model"] = "tiny://qwen2?seed=one"
        expected = r"agents\[sender\]\.model: tiny:// parameter seed must be an integer, got 'one'"
    elif name == "not-yaml":
        path = tmp / "not-yaml.yaml"
        path.write_text("name: [signaling\nagents: {\n")
        return path, r"not valid YAML/JSON"
    elif name == "not-a-mapping":
        path = tmp / "list.yaml"
        path.write_text("- name: signaling\n")
        return path, r"a job spec must be a mapping"
    elif name == "missing-file":
        return tmp / "does-not-exist.yaml", r"cannot read: No such file or directory"
    else:
        raise ValueError(name)
    return write_job(tmp / f"{name}.yaml", spec), expected


@pytest.mark.parametrize("case", ["unknown-field", "micro-batch", "agent-name", "tiny-parameter", "tiny-value",
                                  "not-yaml", "not-a-mapping", "missing-file"])
def test_broken_job_file_is_rejected_with_exit_2(run_dir: Path, etcd_endpoint: str, tmp_path: Path,
                                                 case: str) -> None:
    path, expected = _broken(tmp_path, case)
    before = job_names(etcd_endpoint)
    result = run_cli("submit", str(path), "--run-dir", str(run_dir))
    assert result.returncode == 2, result.explain()
    assert result.stdout == "", result.explain()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.explain()
    assert lines[0].startswith(f"flexmarl submit: {path}: "), result.explain()
    assert re.search(expected, lines[0]), result.explain()
    assert job_names(etcd_endpoint) == before  # nothing was submitted


def test_usage_error_is_exit_2(run_dir: Path) -> None:
    result = run_cli("status", "--run-dir", str(run_dir))  # job id missing
    assert result.returncode == 2, result.explain()
    assert "the following arguments are required: job_id" in result.stderr


def test_prometheus_sd_lists_every_daemon_and_dashboard_metrics_are_served(
    run_dir: Path, etcd_endpoint: str, tmp_path: Path
) -> None:
    """deploy/prometheus/etcd_sd.py against the live cluster; each target's /metrics has the dashboard's names."""
    out = tmp_path / "targets.json"
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "deploy" / "prometheus" / "etcd_sd.py"), "--etcd-endpoints", etcd_endpoint,
         "--out", str(out)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    groups = json.loads(out.read_text())
    kinds = sorted(g["labels"]["kind"] for g in groups)
    assert kinds == ["orchestratord", "rolloutd", "stored", "traind"]
    cluster = json.loads((run_dir / CLUSTER_FILE).read_text())["daemons"]
    by_id = {g["labels"]["service_id"]: g["targets"][0] for g in groups}
    assert by_id["traind-0"] == f"127.0.0.1:{cluster['traind-0']['metrics_port']}"

    served: set[str] = set()
    for group in groups:
        with urllib.request.urlopen(f"http://{group['targets'][0]}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        served.update(re.findall(r"^# TYPE (\S+) ", text, flags=re.M))
        served.update(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, flags=re.M))
    missing = {name for name in dashboard_metric_names() if not family_names(name) & served}
    assert not missing, f"dashboard queries metrics no running daemon serves: {sorted(missing)}"


def test_prometheus_scrapes_every_daemon_and_every_dashboard_query_has_data(
    etcd_endpoint: str, finished_job: tuple[str, CliResult], tmp_path: Path
) -> None:
    """Debian's prometheus reads deploy/prometheus's etcd file_sd; each Grafana query, via its HTTP API, has data."""
    from prometheus_check import PROMETHEUS_BINARY, assert_dashboard_has_data

    assert Path(PROMETHEUS_BINARY).exists(), "prometheus is not installed (./dev.sh setup installs it)"
    assert_dashboard_has_data(etcd_endpoint, tmp_path / "prometheus")


def test_down_stops_every_process_and_removes_cluster_file(run_dir: Path) -> None:
    processes = cluster_processes(run_dir)
    assert len(processes) >= 5  # etcd + 4 daemons (+ the engine replica)
    down = run_cli("down", "--run-dir", str(run_dir), timeout_s=120)
    assert down.returncode == 0, down.explain()
    assert down.stdout.strip() == "stopped 5 processes"
    assert not (run_dir / CLUSTER_FILE).exists()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(gone(p) for p in processes):
        time.sleep(0.1)
    assert [p.pid for p in processes if not gone(p)] == []
    # afterwards the run dir holds no cluster: commands say so with exit 3
    jobs = run_cli("jobs", "--run-dir", str(run_dir))
    assert jobs.returncode == 3, jobs.explain()
