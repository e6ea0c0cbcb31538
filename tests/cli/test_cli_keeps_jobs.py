"""The local cluster keeps its jobs: `flexmarl down` stops the processes and keeps etcd's and stored's data,
`flexmarl up` on the same run dir brings the jobs back, `flexmarl down --wipe` deletes them.

In-process CLI calls against a real local cluster without workers (etcd, stored, orchestratord):
a job that is merely listed needs no training.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_support import ensure_stopped, small_job, write_job

from flexmarl.cli import main
from flexmarl.cluster import LaunchError
from flexmarl.localcluster import CLUSTER_FILE, LocalCluster, LocalClusterConfig

pytestmark = pytest.mark.timeout(180)

NO_WORKERS = ["--rollout-workers", "0", "--trainer-workers", "0"]


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.delenv("FLEXMARL_ORCHESTRATOR", raising=False)
    monkeypatch.delenv("FLEXMARL_ETCD_ENDPOINTS", raising=False)
    path = tmp_path / "run"
    try:
        yield path
    finally:
        ensure_stopped(path)
        main(["down", "--wipe", "--run-dir", str(path)])  # etcd preallocates ~100 MB: leave no data behind


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 0, f"flexmarl {' '.join(args)} -> {code}\n{out}\n{err}"
    return out


def test_down_keeps_jobs_up_restores_them_wipe_deletes_them(run_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    spec = small_job(name="kept")
    for agent in spec["agents"]:
        agent["model"] = "/models/tiny"  # never loaded: the job is cancelled before any worker could start it
    job_file = write_job(tmp_path / "job.yaml", spec)
    where = ["--run-dir", str(run_dir)]

    out = _cli(capsys, "up", "--detach", *where, *NO_WORKERS)
    assert "restored" not in out
    job_id = _cli(capsys, "submit", str(job_file), *where).strip()
    assert _cli(capsys, "cancel", job_id, *where).strip() == f"{job_id}: cancelled"
    etcd_data = Path(json.loads((run_dir / CLUSTER_FILE).read_text())["etcd_data_dir"])

    assert _cli(capsys, "down", *where).strip() == "stopped 3 processes"
    assert (etcd_data / "member").is_dir() and (run_dir / "stored-data").is_dir()

    # Any cluster started on the run dir again restores the jobs; a throwaway one (tests, the demo) too,
    # and it never deletes data it found.
    again = LocalCluster(LocalClusterConfig(run_dir=run_dir, rollout_workers=0, trainer_workers=0))
    again.start()
    try:
        assert again.restored
        # A second cluster on the same run dir (and etcd data) is refused while one runs.
        with pytest.raises(LaunchError, match="a local cluster is already running in"):
            LocalCluster(again.config).start()
        jobs = _cli(capsys, "jobs", *where)
        assert re.search(rf"{job_id}\s*\S\s*kept\s*\S\s*cancelled", jobs), jobs
    finally:
        again.stop()
    assert (etcd_data / "member").is_dir()

    out = _cli(capsys, "down", "--wipe", *where)  # no cluster runs: only the data goes
    assert out.strip() == f"deleted {run_dir / 'etcd' / 'etcd-data'}, {run_dir / 'stored-data'}"
    assert not etcd_data.exists() and not (run_dir / "stored-data").exists()
    assert (run_dir / "orchestratord.log").exists()  # logs stay
