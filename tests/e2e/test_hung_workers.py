"""Hung, not dead (issue 36): an engine replica SIGSTOPped mid-job, its rolloutd alive and renewing.

The stopped replica keeps its connections open and answers nothing; rolloutd's renew loop still
runs, so before progress-based leases its task leases were renewed for as long as the generate
deadline (minutes). Now the tasks stuck on it renew with a progress figure that stands still:
orchestratord refuses them after ``leases.progress_timeout_s`` and re-issues them, rolloutd has
dropped the replica as hung at half that bound, and the job finishes on the other replica with
every experience consumed exactly once. The refusal of a hung worker's late report is asserted
in tests/orchestratord/test_progress_leases.py (a fake clock).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from e2e_support import assert_exactly_once, assert_one_commit_per_step, assert_succeeded, running_cluster

from flexmarl.cluster import wait_until

PROGRESS_TIMEOUT_S = 12.0


@pytest.mark.timeout(240)
def test_a_sigstopped_engine_replica_loses_its_tasks_and_the_job_finishes(tmp_path: Path, models_dir: Path) -> None:
    with running_cluster(tmp_path / "hung", models_dir, engine_replicas=2) as e2e:
        spec = e2e.spec(total_steps=2, leases={"rollout_timeout_s": 10, "train_timeout_s": 60,
                                               "progress_timeout_s": PROGRESS_TIMEOUT_S})
        job_id = e2e.client.submit(spec)
        wait_until(lambda: len(e2e.engine_pids()) == 2, 120, "rolloutd to launch its two engine replicas", 0.2)
        rolloutd_log = e2e.run_dir / "rolloutd-0.log"
        # Mid-rollout of batch 0: both replicas serve an agent (their weights loaded), no step committed yet.
        wait_until(lambda: rolloutd_log.read_text().count(" now serves ") >= 2, 120,
                   "both replicas to serve an agent", 0.1)
        victim = e2e.engine_pids()[0]
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            orchestratord_log = e2e.run_dir / "orchestratord.log"
            wait_until(lambda: " hung: dropped" in rolloutd_log.read_text(), 60,
                       "rolloutd to drop the stopped replica as hung", 0.2)
            dropped_s = time.monotonic() - stopped_at
            info = e2e.wait_job(job_id)
            finished_s = time.monotonic() - stopped_at
            assert_succeeded(e2e, info, 2)
            assert_one_commit_per_step(e2e, job_id, spec)
            assert_exactly_once(e2e, job_id, spec)
            refused = [line for line in orchestratord_log.read_text().splitlines() if "no progress for" in line]
            print(f"replica dropped {dropped_s:.1f} s after SIGSTOP; job finished {finished_s:.1f} s after it; "
                  f"{len(refused)} leases refused for no progress")
            # Tasks stuck on the replica were refused, not left to the generate deadline (300 s).
            assert refused, f"no lease was refused for lack of progress:\n{e2e.log_tails()}"
            assert all(f"progress_timeout_s {PROGRESS_TIMEOUT_S:g}" in line for line in refused)
            assert dropped_s < 60 and finished_s < 150
        finally:
            os.kill(victim, signal.SIGCONT)
