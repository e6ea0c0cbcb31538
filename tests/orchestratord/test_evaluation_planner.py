"""Held-out evaluation in the planner: rounds at versions, leased beside training, never trained on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from flexmarl.errors import FailedPrecondition, InvalidArgument, NotFound
from flexmarl.evaluation import EvalEpisode, EvalRecord, aggregate
from flexmarl.ids import EvalTaskRef, ExperienceKey, TaskRef
from orchestratord.planner import (
    AgentVersion,
    MicroBatchWork,
    OptimizerStepWork,
    Planner,
    PlannerOptions,
    RolloutTaskLease,
    WarmStartWork,
)
from orchestratord.state import EvalRecorded, InMemoryStateStore, JobState, ManifestFixed, apply_changes

from .helpers import FakeClock, experiences_for, make_spec

AGENTS = ("sender", "receiver")
EVAL = {"every_versions": 2, "tasks": 3, "samples_per_task": 2, "sampling": "policy", "before_training": True,
        "success_threshold": 1.0}


def episodes_for(lease: RolloutTaskLease, returns: Any = None) -> list[EvalEpisode]:
    """Sample i of task t: the sender returns float(t == i), the receiver 1.0; at the lease's versions."""
    versions = {v.agent: (v.version,) for v in lease.agent_versions}
    return [EvalEpisode(lease.task_index, i, returns or {"sender": float(lease.task_index == i), "receiver": 1.0},
                        None, versions) for i in range(lease.group_size)]


def drive(planner: Planner, job_id: str, changes: list[Any], max_rounds: int = 2000) -> list[RolloutTaskLease]:
    """Runs a job with one rollout worker and one slot; returns every lease in order. Collects durable changes."""
    job = planner.job(job_id)
    leases: list[RolloutTaskLease] = []
    for _ in range(max_rounds):
        changes.extend(planner.take_changes())
        if job.state.terminal:
            return leases
        for lease in planner.lease_rollout_tasks("roll-0", 2):
            leases.append(lease)
            if lease.evaluation:
                planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "", (),
                                            eval_episodes=episodes_for(lease))
            else:
                planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "",
                                            experiences_for(lease, AGENTS))
        work = planner.poll_trainer_work("trainer-0", "slot-0")
        if isinstance(work, MicroBatchWork):
            planner.ack_micro_batch(work.lease_id, "trainer-0", "slot-0")
        elif isinstance(work, OptimizerStepWork):
            planner.commit_step("trainer-0", "slot-0", work.job_id, work.agent, work.step, work.new_version,
                                f"file:///w/{work.agent}/{work.new_version}", f"file:///s/{work.agent}/{work.new_version}")
        elif isinstance(work, WarmStartWork):
            planner.commit_step("trainer-0", "slot-0", work.job_id, work.agent, 0, 0, f"file:///w/{work.agent}/warm",
                                f"file:///s/{work.agent}/warm")
    raise AssertionError(f"job did not finish: {job.snapshot()}")


def test_aggregation_equals_a_hand_computation() -> None:
    # Two tasks x 2 samples; threshold 1.0.
    eps = [
        EvalEpisode(0, 0, {"a": 1.0, "b": 0.0}, None, {"a": (3,), "b": (2,)}),
        EvalEpisode(0, 1, {"a": 0.0, "b": 1.0}, None, {"a": (3, 4), "b": (2,)}),
        EvalEpisode(1, 0, {"a": 0.5, "b": 1.0}, None, {"a": (3,), "b": (2,)}),
        EvalEpisode(1, 1, {"a": 1.0, "b": 1.0}, None, {"a": (4,), "b": (2,)}),
    ]
    record = aggregate(eps, agents=("a", "b"), agent_versions={"a": 3, "b": 2}, version=2, tasks=2,
                       samples_per_task=2, failed_tasks=0, sampling="policy", success_threshold=1.0)
    a, b = record.scores_of("a"), record.scores_of("b")
    assert (a.reward_mean, a.success, a.pass_at_k, a.episodes) == (2.5 / 4, 2 / 4, 2 / 2, 4)
    assert (b.reward_mean, b.success, b.pass_at_k) == (3.0 / 4, 3 / 4, 2 / 2)
    # Team: mean of the agents' returns per episode; success = both agents succeeded (no note): only (1, 1).
    assert record.team.reward_mean == pytest.approx((0.5 + 0.5 + 0.75 + 1.0) / 4)
    assert (record.team.success, record.team.pass_at_k) == (1 / 4, 1 / 2)
    assert record.agents[0].versions_seen == (3, 4) and record.agents[1].versions_seen == (2,)
    assert not record.team_success_from_env
    # The environment's note decides the team's success where an episode sets it.
    noted = [EvalEpisode(e.task_index, e.sample_index, e.returns, e.task_index == 0, e.versions) for e in eps]
    team = aggregate(noted, agents=("a", "b"), agent_versions={}, version=2, tasks=2, samples_per_task=2,
                     failed_tasks=0, sampling="policy", success_threshold=1.0)
    assert (team.team.success, team.team.pass_at_k, team.team_success_from_env) == (2 / 4, 1 / 2, True)
    assert EvalRecord.from_dict(record.as_dict()) == record
    # A workflow's per-role share of correct outputs: the mean over the episodes that name the role.
    roles = [EvalEpisode(0, i, {"a": 1.0}, None, {}, {"solver": share, **({"judge": 1.0} if i else {})})
             for i, share in enumerate((0.5, 1.0, 0.0))]
    by_role = aggregate(roles, agents=("a",), agent_versions={}, version=0, tasks=1, samples_per_task=3,
                        failed_tasks=0, sampling="policy", success_threshold=1.0)
    assert by_role.role_correct == {"judge": 1.0, "solver": 0.5}
    assert EvalRecord.from_dict(by_role.as_dict()) == by_role


def test_rounds_run_beside_training_are_never_trained_on_and_the_job_ends_after_the_last() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e"))
    spec = make_spec(evaluation=EVAL)
    planner.submit_job("ev", spec)
    changes: list[Any] = []
    leases = drive(planner, "ev", changes)
    assert planner.job("ev").state is JobState.SUCCEEDED

    records = [c for c in changes if isinstance(c, EvalRecorded)]
    # before_training (0), every 2nd version (2) and the final one (3 = total_steps).
    assert [r.round_id for r in records] == ["v0", "v2", "v3"]
    state_changes = [c for c in changes if type(c).__name__ == "JobStateChanged"]
    assert state_changes[-1].state is JobState.SUCCEEDED
    assert changes.index(records[-1]) < changes.index(state_changes[-1]), "the job ended before its last round"

    eval_leases = [lease for lease in leases if lease.evaluation]
    assert {EvalTaskRef.parse(lease.task_id).round_id for lease in eval_leases} == {"v0", "v2", "v3"}
    assert all(lease.group_size == 2 and not lease.greedy and not lease.pinned for lease in eval_leases)
    # No manifest holds anything but training tasks' experiences.
    manifests = [c.manifest for c in changes if isinstance(c, ManifestFixed)]
    assert manifests
    for manifest in manifests:
        for eid in manifest.experience_ids:
            TaskRef.parse(ExperienceKey.parse(eid).task_id)  # raises for an eval task id
    # Training tasks and their indices are the ones a job without evaluation gets.
    plain = Planner(FakeClock(), PlannerOptions(lease_epoch="e"))
    plain.submit_job("ev", make_spec())
    plain_leases = drive(plain, "ev", [])
    assert [(t.task_id, t.task_index) for t in leases if not t.evaluation] == \
        [(t.task_id, t.task_index) for t in plain_leases]

    # The recorded figures are the hand-computed ones: sender succeeds in sample t of task t (tasks 0, 1 of 3).
    final = EvalRecord.from_dict(records[-1].record)
    sender = final.scores_of("sender")
    assert (sender.success, sender.pass_at_k, sender.episodes) == (2 / 6, 2 / 3, 6)
    assert final.scores_of("receiver").success == 1.0
    assert final.team.success == 2 / 6
    assert final.version == 3 and {a.agent: a.version for a in final.agents} == {"sender": 3, "receiver": 3}


def test_while_training_tasks_wait_at_most_one_eval_task_is_in_flight() -> None:
    planner = Planner(FakeClock(), PlannerOptions(lease_epoch="e"))
    planner.submit_job("ev", make_spec(evaluation=EVAL, pipeline={"mode": "async", "max_staleness": 1}))
    first = planner.lease_rollout_tasks("roll-0", 8)
    assert sum(lease.evaluation for lease in first) == 1  # 8 training tasks admissible: one eval goes along
    assert sum(not lease.evaluation for lease in first) == 7
    more = planner.lease_rollout_tasks("roll-1", 1)
    assert [lease.evaluation for lease in more] == [False]  # training still waits: no second eval task
    # No training task left to hand out: the round's other tasks go out.
    rest = planner.lease_rollout_tasks("roll-1", 8)
    assert len(rest) == 2 and all(lease.evaluation for lease in rest)


def test_an_eval_lease_lost_to_expiry_or_a_dead_worker_is_issued_again_and_its_late_report_refused() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e", max_task_attempts=3))
    planner.submit_job("ev", make_spec(evaluation={**EVAL, "tasks": 1}, pipeline={"mode": "sync"}))
    lease = next(t for t in planner.lease_rollout_tasks("roll-0", 8) if t.evaluation)
    clock.advance(11)  # past rollout_timeout_s
    again = next(t for t in planner.lease_rollout_tasks("roll-1", 8) if t.evaluation)
    assert again.task_id == lease.task_id and again.attempt == 2
    with pytest.raises(FailedPrecondition):
        planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "", (),
                                    eval_episodes=episodes_for(lease))
    planner.worker_gone("roll-1")
    third = next(t for t in planner.lease_rollout_tasks("roll-2", 8) if t.evaluation)
    assert third.attempt == 3
    # A failed third attempt gives the task up: the round is recorded without it, the job goes on.
    planner.report_rollout_task(third.lease_id, "roll-2", third.task_id, False, "boom", ())
    recorded = [c for c in planner.take_changes() if isinstance(c, EvalRecorded)]
    assert len(recorded) == 1 and recorded[0].record["failed_tasks"] == 1
    assert planner.job("ev").state is JobState.RUNNING
    with pytest.raises(NotFound):  # the round is over: its leases are forgotten
        planner.report_rollout_task(third.lease_id, "roll-2", third.task_id, True, "", (),
                                    eval_episodes=episodes_for(third))


def test_malformed_eval_reports_are_refused_and_the_task_issued_again() -> None:
    planner = Planner(FakeClock(), PlannerOptions(lease_epoch="e"))
    planner.submit_job("ev", make_spec(evaluation={**EVAL, "tasks": 1}, pipeline={"mode": "sync"}))
    training: list[RolloutTaskLease] = []
    for bad in (lambda lease: {"experiences": experiences_for(lease, AGENTS)},
                lambda lease: {"eval_episodes": episodes_for(lease)[:1]},
                lambda lease: {"eval_episodes": episodes_for(lease, {"sender": 1.0, "nobody": 1.0})},
                lambda lease: {"eval_episodes": [EvalEpisode(lease.task_index, i, {}, None, {"sender": (7,)})
                                                 for i in range(2)]},
                lambda lease: {"eval_episodes": [EvalEpisode(lease.task_index, i, {}, None, {}, {"solver": 1.5})
                                                 for i in range(2)]}):
        leased = planner.lease_rollout_tasks("roll-0", 8)
        training.extend(t for t in leased if not t.evaluation)
        lease = next(t for t in leased if t.evaluation)
        kwargs = bad(lease)
        with pytest.raises(InvalidArgument):
            planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "",
                                        kwargs.get("experiences", ()), eval_episodes=kwargs.get("eval_episodes", ()))
        # a rejected report with experiences leaves the lease held: it expires; the others were re-queued
        if "experiences" in kwargs:
            planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, False, "retry", ())
    task = training[0]
    with pytest.raises(InvalidArgument):
        planner.report_rollout_task(task.lease_id, "roll-0", task.task_id, True, "",
                                    experiences_for(task, AGENTS), eval_episodes=episodes_for(task))


async def test_a_restored_orchestrator_skips_recorded_rounds_and_reopens_the_current_one() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e"))
    planner.submit_job("ev", make_spec(evaluation=EVAL))
    store = InMemoryStateStore()
    changes: list[Any] = []
    drive(planner, "ev", changes)
    await apply_changes(store, changes)
    persisted = await store.load_job("ev")
    assert persisted is not None and persisted.eval_rounds == frozenset({"v0", "v2", "v3"})
    restored = Planner(clock, PlannerOptions(lease_epoch="f")).restore_job(persisted, [])
    assert restored.state is JobState.SUCCEEDED

    # A job restored at version 0 whose before_training round was never recorded opens it again.
    fresh = Planner(clock, PlannerOptions(lease_epoch="e"))
    fresh.submit_job("ev0", make_spec(evaluation=EVAL))
    store0 = InMemoryStateStore()
    await apply_changes(store0, fresh.take_changes())
    persisted0 = await store0.load_job("ev0")
    assert persisted0 is not None
    again = Planner(clock, PlannerOptions(lease_epoch="f"))
    again.restore_job(persisted0, [])
    assert any(t.evaluation and EvalTaskRef.parse(t.task_id).round_id == "v0"
               for t in again.lease_rollout_tasks("roll-0", 8))


async def test_an_open_on_demand_round_finishes_after_a_restart_without_replaying_its_finished_tasks() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e", max_task_attempts=1))
    planner.submit_job("ev", make_spec())
    store = InMemoryStateStore()
    changes: list[Any] = []
    drive(planner, "ev", changes)
    job = planner.job("ev")
    pinned = [AgentVersion("ev", "sender", 1, "file:///w/sender/1"), AgentVersion("ev", "receiver", 3, "file:///r")]
    assert job.open_evaluation(pinned, 4) == "d1"
    leases = {EvalTaskRef.parse(t.task_id).index: t for t in planner.lease_rollout_tasks("roll-0", 8)}
    assert sorted(leases) == [0, 1, 2, 3]
    planner.report_rollout_task(leases[0].lease_id, "roll-0", leases[0].task_id, True, "", (),
                                eval_episodes=episodes_for(leases[0]))
    planner.report_rollout_task(leases[3].lease_id, "roll-0", leases[3].task_id, False, "engine died", ())
    await apply_changes(store, [*changes, *planner.take_changes()])  # task 3 given up (1 attempt allowed)

    persisted = await store.load_job("ev")
    assert persisted is not None and [r.round_id for r in persisted.open_evals] == ["d1"]
    restarted = Planner(clock, PlannerOptions(lease_epoch="f"))
    restarted.restore_job(persisted, [])
    again = restarted.lease_rollout_tasks("roll-1", 8)
    # Only the tasks unfinished at the restart, on exactly the asked versions and weights.
    assert sorted(EvalTaskRef.parse(t.task_id).index for t in again) == [1, 2]
    assert all(t.pinned and t.attempt == 1 for t in again)
    assert {v.agent: (v.version, v.weights_uri) for v in again[0].agent_versions} == {
        "sender": (1, "file:///w/sender/1"), "receiver": (3, "file:///r")}
    for lease in again:
        restarted.report_rollout_task(lease.lease_id, "roll-1", lease.task_id, True, "", (),
                                      eval_episodes=episodes_for(lease, {"sender": 0.0, "receiver": 1.0}))
    after = restarted.take_changes()
    recorded = [EvalRecord.from_dict(c.record) for c in after if isinstance(c, EvalRecorded)]
    assert [(r.round_id, r.tasks, r.failed_tasks) for r in recorded] == [("d1", 4, 1)]
    # Task 0's episode (the sender's 1.0) came through the restart: 1 success in 3 episodes.
    assert recorded[0].scores_of("sender").success == pytest.approx(1 / 3)
    await apply_changes(store, after)
    persisted = await store.load_job("ev")
    assert persisted is not None and persisted.open_evals == () and "d1" in persisted.eval_rounds
    # A round recorded is never played again; the next on-demand round is d2.
    once_more = Planner(clock, PlannerOptions(lease_epoch="g"))
    restored = once_more.restore_job(persisted, [])
    assert once_more.lease_rollout_tasks("roll-1", 8) == []
    assert restored.open_evaluation(pinned, 1) == "d2"


async def test_a_periodic_round_keeps_its_finished_tasks_and_a_finished_round_is_recorded_at_restore() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e"))
    planner.submit_job("ev", make_spec(evaluation=EVAL))  # before_training: round v0 opens with the job
    store = InMemoryStateStore()
    first = planner.lease_rollout_tasks("roll-0", 1)
    assert [EvalTaskRef.parse(t.task_id).round_id for t in first] == ["v0"]
    planner.report_rollout_task(first[0].lease_id, "roll-0", first[0].task_id, True, "", (),
                                eval_episodes=episodes_for(first[0]))
    await apply_changes(store, planner.take_changes())
    persisted = await store.load_job("ev")
    assert persisted is not None and [(r.round_id, len(r.finished)) for r in persisted.open_evals] == [("v0", 1)]
    restarted = Planner(clock, PlannerOptions(lease_epoch="f"))
    restarted.restore_job(persisted, [])
    pending = [t for t in restarted.lease_rollout_tasks("roll-1", 16) if t.evaluation]
    finished = EvalTaskRef.parse(first[0].task_id).index
    assert sorted(EvalTaskRef.parse(t.task_id).index for t in pending) == sorted({0, 1, 2} - {finished})

    # Every task's result written, the record not (a restart in between): recorded at restore, nothing replayed.
    for lease in pending:
        restarted.report_rollout_task(lease.lease_id, "roll-1", lease.task_id, True, "", (),
                                      eval_episodes=episodes_for(lease))
    written = [c for c in restarted.take_changes() if not isinstance(c, EvalRecorded)]
    await apply_changes(store, written)
    persisted = await store.load_job("ev")
    assert persisted is not None and [len(r.finished) for r in persisted.open_evals] == [3]
    third = Planner(clock, PlannerOptions(lease_epoch="g"))
    third.restore_job(persisted, [])
    recorded = [c.round_id for c in third.take_changes() if isinstance(c, EvalRecorded)]
    assert recorded == ["v0"] and not any(t.evaluation for t in third.lease_rollout_tasks("roll-2", 16))


def test_an_on_demand_round_plays_exactly_the_asked_versions_also_after_the_job_succeeded() -> None:
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e"))
    planner.submit_job("ev", make_spec())  # no evaluation section: the defaults apply
    drive(planner, "ev", [])
    job = planner.job("ev")
    assert job.state is JobState.SUCCEEDED
    pinned = [AgentVersion("ev", "sender", 1, "file:///w/sender/1"), AgentVersion("ev", "receiver", 3, "file:///r")]
    with pytest.raises(InvalidArgument):  # not every agent
        job.open_evaluation(pinned[:1], 2)
    with pytest.raises(InvalidArgument):  # a version not reached
        job.open_evaluation([pinned[0], AgentVersion("ev", "receiver", 4, "")], 2)
    assert job.open_evaluation(pinned, 2) == "d1"
    with pytest.raises(FailedPrecondition):  # one at a time
        job.open_evaluation(pinned, 2)
    leases = planner.lease_rollout_tasks("roll-0", 8)
    assert [EvalTaskRef.parse(t.task_id).round_id for t in leases] == ["d1", "d1"]
    assert all(t.pinned and t.evaluation and t.group_size == 1 for t in leases)
    assert {v.agent: (v.version, v.weights_uri) for v in leases[0].agent_versions} == {
        "sender": (1, "file:///w/sender/1"), "receiver": (3, "file:///r")}
    clock.advance(11)  # an expired lease of an ended job's round is issued again
    again = planner.lease_rollout_tasks("roll-1", 8)
    assert [t.attempt for t in again] == [2, 2]
    for lease in again:
        planner.report_rollout_task(lease.lease_id, "roll-1", lease.task_id, True, "", (),
                                    eval_episodes=episodes_for(lease))
    recorded = [c for c in planner.take_changes() if isinstance(c, EvalRecorded)]
    assert [c.round_id for c in recorded] == ["d1"]
    record = EvalRecord.from_dict(recorded[0].record)
    assert record.on_demand and record.version == 1
    assert {a.agent: (a.version, a.versions_seen) for a in record.agents} == {"sender": (1, (1,)),
                                                                            "receiver": (3, (3,))}
    assert job.open_evaluation(pinned, 1) == "d2"
    job.cancel()
    with pytest.raises(FailedPrecondition):
        job.open_evaluation(pinned, 1)


class HistoryStore(InMemoryStateStore):
    """The in-memory store with the etcd store's history reads (what JobCoordinator.evaluate_job reads)."""

    async def load_history_page(self, job_id: str, agents: Sequence[str], from_step: int,
                                max_steps: int) -> tuple[list[dict[str, Any]], bool]:
        rows = [r for r in self._jobs[job_id].get("history", {}).values() if r["agent"] in agents]
        end = from_step + max_steps
        return [r for r in rows if from_step <= r["step"] < end], any(r["step"] >= end for r in rows)

    async def load_evals(self, job_id: str) -> list[dict[str, Any]]:
        return list(self._jobs[job_id]["evals"].values())


async def test_flexmarl_eval_takes_kept_versions_only_with_their_weights_from_the_history() -> None:
    import json
    import types

    from prometheus_client import CollectorRegistry

    from orchestratord.coordinator import JobCoordinator
    from orchestratord.metrics import OrchestratorMetrics

    from .helpers import spec_dict

    registry: Any = types.SimpleNamespace(prefix="/test")  # nothing here reaches etcd or stored
    coordinator = JobCoordinator(registry, OrchestratorMetrics(CollectorRegistry()), now_s=FakeClock())
    coordinator.state = HistoryStore()  # type: ignore[assignment]
    await coordinator.submit_job(json.dumps(spec_dict(checkpoint={"keep_last": 2}, total_steps=3)), "ev")
    changes: list[Any] = []
    await coordinator.mutate(lambda: drive(coordinator.planner, "ev", changes))
    await coordinator._persist(changes)  # drive took them from the planner's outbox: write them as mutate would
    assert coordinator.planner.job("ev").state is JobState.SUCCEEDED

    with pytest.raises(FailedPrecondition, match="version 1 of sender is not kept"):
        await coordinator.evaluate_job("ev", {"sender": 1}, 2)  # keep_last 2 of 3: versions 2 and 3 (and 0)
    with pytest.raises(InvalidArgument, match="sender has versions 0..3, not 4"):
        await coordinator.evaluate_job("ev", {"sender": 4}, 2)
    with pytest.raises(InvalidArgument, match="no agents"):
        await coordinator.evaluate_job("ev", {"nobody": 1}, 2)
    assert await coordinator.evaluate_job("ev", {"sender": 2, "receiver": 0}, 2) == "d1"
    leases = coordinator.planner.lease_rollout_tasks("roll-0", 4)
    assert {v.agent: (v.version, v.weights_uri) for v in leases[0].agent_versions} == {
        "sender": (2, "file:///w/sender/2"), "receiver": (0, "")}
    assert all(lease.pinned for lease in leases)


async def test_flexmarl_eval_of_a_warm_started_version_zero_plays_its_published_weights() -> None:
    import json
    import types

    from prometheus_client import CollectorRegistry

    from orchestratord.coordinator import JobCoordinator
    from orchestratord.metrics import OrchestratorMetrics

    from .helpers import spec_dict

    registry: Any = types.SimpleNamespace(prefix="/test")
    coordinator = JobCoordinator(registry, OrchestratorMetrics(CollectorRegistry()), now_s=FakeClock())
    coordinator.state = HistoryStore()  # type: ignore[assignment]
    spec = spec_dict(total_steps=2)
    spec["agents"][0]["warm_start"] = {"dataset": "examples.arithmetic.data:solver_examples", "steps": 2}
    await coordinator.submit_job(json.dumps(spec), "ws")
    changes: list[Any] = []
    await coordinator.mutate(lambda: drive(coordinator.planner, "ws", changes))
    await coordinator._persist(changes)
    assert coordinator.planner.job("ws").state is JobState.SUCCEEDED
    assert await coordinator.evaluate_job("ws", {"sender": 0, "receiver": 0}, 2) == "d1"
    leases = coordinator.planner.lease_rollout_tasks("roll-0", 4)
    assert {v.agent: (v.version, v.weights_uri) for v in leases[0].agent_versions} == {
        "sender": (0, "file:///w/sender/warm"), "receiver": (0, "")}


async def test_an_on_demand_round_samples_as_it_asks_whatever_the_jobs_evaluation_says() -> None:
    """flexmarl eval --sampling policy --samples 3 on a job without evaluation (greedy, 1): the round's own."""
    clock = FakeClock()
    planner = Planner(clock, PlannerOptions(lease_epoch="e"))
    planner.submit_job("ev", make_spec())
    changes: list[Any] = []
    drive(planner, "ev", changes)
    job = planner.job("ev")
    pinned = [AgentVersion("ev", "sender", 1, "file:///w/sender/1"), AgentVersion("ev", "receiver", 3, "file:///r")]
    for bad in ({"sampling": "hot"}, {"samples_per_task": 1025}, {"samples_per_task": -1}):
        with pytest.raises(InvalidArgument, match=next(iter(bad))):
            job.open_evaluation(pinned, 2, **bad)  # type: ignore[arg-type]
    assert job.open_evaluation(pinned, 2, sampling="policy", samples_per_task=3) == "d1"
    store = InMemoryStateStore()
    await apply_changes(store, [*changes, *planner.take_changes()])
    persisted = await store.load_job("ev")
    assert persisted is not None and [(r.sampling, r.samples_per_task) for r in persisted.open_evals] == [("policy", 3)]
    restarted = Planner(clock, PlannerOptions(lease_epoch="f"))  # the round's settings outlive a restart
    restarted.restore_job(persisted, [])
    leases = restarted.lease_rollout_tasks("roll-0", 8)
    assert [(t.greedy, t.group_size) for t in leases] == [(False, 3), (False, 3)]
    for lease in leases:
        restarted.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "", (),
                                      eval_episodes=episodes_for(lease))
    (record,) = [EvalRecord.from_dict(c.record) for c in restarted.take_changes() if isinstance(c, EvalRecorded)]
    assert (record.round_id, record.sampling, record.samples_per_task, record.team.episodes) == ("d1", "policy", 3, 6)
    # The next round asks nothing of its own: the job's settings (no evaluation section: greedy, one sample).
    assert restarted.job("ev").open_evaluation(pinned, 2) == "d2"
    assert [(t.greedy, t.group_size) for t in restarted.lease_rollout_tasks("roll-0", 8)] == [(True, 1), (True, 1)]


def test_a_round_persisted_before_rounds_carried_their_sampling_reads_as_the_jobs() -> None:
    from orchestratord.eval_state import OpenEvalRound

    old = '{"agent_versions":[["a",1,"file:///w"]],"eval_file":"","eval_sha256":"","on_demand":true,' \
          '"round_id":"d1","samples_per_task":2,"tasks":4,"version":1}'
    opened = OpenEvalRound.from_json(old)
    assert opened.sampling == "" and OpenEvalRound.from_json(opened.to_json()) == opened
