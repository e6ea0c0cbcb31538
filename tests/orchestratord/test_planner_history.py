"""The planner's memory does not grow with a job's history: old manifests and commits live in etcd only."""

from __future__ import annotations

from orchestratord.planner import Planner
from orchestratord.planner.job_plan import KEPT_COMMITTED_STEPS
from orchestratord.state import ManifestFixed, StepCommitted

from .helpers import FakeClock, make_spec, run_job


def test_a_long_job_keeps_only_the_last_committed_steps_in_memory() -> None:
    clock = FakeClock()
    planner = Planner(clock)
    steps = 12
    planner.submit_job("job", make_spec(total_steps=steps))
    run_job(planner, clock, "job")
    job = planner.job("job")
    committed = [c.commit for c in planner.take_changes() if isinstance(c, StepCommitted)]
    assert len(committed) == 2 * steps  # every commit was emitted for etcd
    for agent in job.spec.agent_names:
        for step in range(steps):
            kept = step >= steps - KEPT_COMMITTED_STEPS
            assert (job.manifest(agent, step) is not None) == kept, (agent, step)


def test_every_commit_carries_its_manifest_for_the_coordinator_after_the_planner_forgot_it() -> None:
    """A commit whose etcd write waited out an outage is observed after later commits: its change holds the manifest."""
    clock = FakeClock()
    planner = Planner(clock)
    steps = 6
    planner.submit_job("job", make_spec(total_steps=steps))
    run_job(planner, clock, "job")
    changes = planner.take_changes()
    fixed = {(c.manifest.agent, c.manifest.step): c.manifest for c in changes if isinstance(c, ManifestFixed)}
    commits = [c for c in changes if isinstance(c, StepCommitted)]
    assert len(commits) == 2 * steps
    for change in commits:
        key = (change.commit.agent, change.commit.step)
        assert change.manifest == fixed[key] and change.manifest.experience_ids, key
    assert planner.job("job").manifest("sender", 0) is None  # forgotten by the planner, carried by the change
