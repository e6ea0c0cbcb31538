"""A three-member etcd under a running job: one member dies (the job goes on), then a second (no quorum:
the daemons keep serving what they hold, their writes wait, none exits), then both come back and the job
finishes with one commit per step and every experience consumed exactly once.

The daemons get every member's endpoint; their registry client uses one gRPC channel over all members,
which moves to a live member when the one it used dies (flexmarl.registry._members_target). The member
killed first is the one every channel started on.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2e_support import assert_exactly_once, assert_one_commit_per_step, assert_succeeded, running_cluster

from flexmarl.cluster import EtcdCluster, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

STEPS = 8


def test_a_job_survives_one_etcd_member_and_waits_out_a_lost_quorum(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "run", tmp_path / "models", etcd_members=3) as e2e:
        etcd = e2e.cluster.etcd
        assert isinstance(etcd, EtcdCluster) and len(etcd.members) == 3
        spec = e2e.spec(total_steps=STEPS)
        agents = [a["name"] for a in spec["agents"]]
        job_id = e2e.client.submit(spec)
        e2e.wait_for_commits(job_id, len(agents))

        def committed() -> int:
            return sum(a.version for a in e2e.client.status(job_id).agents)

        # One member dies: two of three are a quorum, and the job goes on.
        etcd.members[0].kill()
        lost_one_s = time.monotonic()
        at_loss = committed()
        e2e.wait_for_commits(job_id, at_loss + len(agents), timeout_s=120)
        one_down_s = time.monotonic() - lost_one_s

        # A second dies: no quorum. orchestratord's writes wait (it says so), it keeps answering from
        # what it holds, and no daemon exits.
        etcd.members[1].kill()
        orch_log = e2e.run_dir / "orchestratord.log"
        unavailable_before = orch_log.read_text().count("etcd unavailable")
        wait_until(lambda: orch_log.read_text().count("etcd unavailable") > unavailable_before, 90,
                   "orchestratord's writes to wait for etcd", 0.2)
        held = committed()
        assert e2e.client.status(job_id).state.name == "RUNNING"
        dead = [name for name, proc in e2e.cluster.daemons.items() if not proc.alive()]
        assert dead == [], f"daemons exited without an etcd quorum: {dead}\n{e2e.log_tails()}"

        # Both come back (same data, same ports): the job finishes exactly once.
        for member in etcd.members[:2]:
            member.spawn()
        for member in etcd.members[:2]:
            member.wait_healthy(60)
        info = e2e.wait_job(job_id, timeout_s=240)
        assert_succeeded(e2e, info, STEPS)
        assert_one_commit_per_step(e2e, job_id, spec)
        assert_exactly_once(e2e, job_id, spec)
        assert [name for name, proc in e2e.cluster.daemons.items() if not proc.alive()] == []
        print(f"\netcd quorum: {STEPS} steps; with one member down {len(agents)} more commits in {one_down_s:.1f} s; "
              f"{held} commits held through the lost quorum")


def test_a_run_dir_is_started_with_the_member_count_of_its_data(tmp_path: Path) -> None:
    """Data of a one-member etcd is not silently replaced by a fresh three-member cluster (its jobs would vanish)."""
    from flexmarl.cluster import LaunchError
    from flexmarl.localcluster import LocalCluster, LocalClusterConfig

    (tmp_path / "etcd" / "etcd-data" / "member").mkdir(parents=True)
    with pytest.raises(LaunchError, match=r"^the run dir holds the data of a 1-member etcd; start it with "
                                          r"--etcd-members 1 \(or delete its jobs with `flexmarl down --wipe`\)$"):
        LocalCluster(LocalClusterConfig(run_dir=tmp_path, etcd_members=3)).start()
    # --secure with several members: every member serves TLS, auth is on (tests/security/test_etcd_cluster_tls.py).
    secure = LocalCluster(LocalClusterConfig(run_dir=tmp_path / "other", etcd_members=3, secure=True))
    secure._secure_etcd()
    assert isinstance(secure.etcd, EtcdCluster) and len(secure.etcd.members) == 3
    assert all(m.tls is not None and m.peer_tls for m in secure.etcd.members)
    assert secure.certs is not None and secure.etcd.client_args()[:2] == ["--etcd-ca", str(secure.certs.ca)]
    assert secure.etcd.username == "root" and secure.etcd.password_file is not None
