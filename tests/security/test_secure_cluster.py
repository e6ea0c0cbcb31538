"""A whole local cluster with TLS and the token on every daemon trains a small job (~35 s)."""

from __future__ import annotations

import sys
from pathlib import Path

from flexmarl.cli import materialize_models
from flexmarl.client import Client, JobState
from flexmarl.localcluster import LocalCluster, LocalClusterConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_support import small_job  # noqa: E402


def test_secure_local_cluster_trains_and_keeps_the_token_out_of_logs(tmp_path: Path) -> None:
    with LocalCluster(LocalClusterConfig(run_dir=tmp_path / "run", engine_replicas=1, secure=True)) as cluster:
        certs = cluster.certs
        assert certs is not None
        spec = materialize_models(small_job(), tmp_path / "models")
        with Client(etcd_endpoints=cluster.etcd_endpoint, tls_ca=str(certs.ca), token_file=str(certs.token_file),
                    timeout_s=10) as client:
            job_id = client.submit(spec)
            final = client.wait(job_id, timeout_s=240)
        assert final.state is JobState.SUCCEEDED, final.error
        token = certs.token_file.read_text().strip()
        for proc in cluster.daemons.values():
            text = proc.log_path.read_text()
            assert token not in text, proc.name
            assert "UNAUTHENTICATED" not in text, proc.name
