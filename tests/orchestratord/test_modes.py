"""Pipeline modes beyond async/sync: ``sequential`` (MAS-RL-like), ``static`` (MARTI-like), static binding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from flexmarl.errors import InvalidArgument
from orchestratord.planner import MicroBatchWork, OptimizerStepWork, Planner, PlannerOptions, SwapOutWork
from orchestratord.state import JobState

from .helpers import FakeClock, experiences_for, make_spec, run_job, spec_dict

THREE_AGENTS = [{"name": "a0", "model": "/m"}, {"name": "a1", "model": "/m"}, {"name": "a2", "model": "/m"}]


def _drive(planner: Planner, clock: FakeClock, job_id: str, slots: Sequence[str],
           max_rounds: int = 5_000) -> list[tuple[str, str, Any]]:
    """Runs a job with healthy workers; returns events ("lease", task lease) / ("work", slot, work) in order."""
    job = planner.job(job_id)
    agents = job.spec.agent_names
    events: list[tuple[str, str, Any]] = []
    for _ in range(max_rounds):
        if job.state.terminal:
            return events
        progressed = False
        for lease in planner.lease_rollout_tasks("roll-0", 4):
            events.append(("lease", "roll-0", lease))
            planner.report_rollout_task(lease.lease_id, "roll-0", lease.task_id, True, "",
                                        experiences_for(lease, agents))
            progressed = True
        for slot in slots:
            work = planner.poll_trainer_work(f"trainer-{slot}", slot)
            if work is None:
                continue
            progressed = True
            events.append(("work", slot, work))
            if isinstance(work, MicroBatchWork):
                planner.ack_micro_batch(work.lease_id, f"trainer-{slot}", slot)
            elif isinstance(work, OptimizerStepWork):
                planner.commit_step(f"trainer-{slot}", slot, job_id, work.agent, work.step, work.new_version,
                                    f"file:///w/{work.agent}/{work.new_version}",
                                    f"file:///s/{work.agent}/{work.new_version}")
                events.append(("commit", slot, work))
            elif isinstance(work, SwapOutWork):  # pragma: no cover - file:// states never need a swap-out
                raise AssertionError("unexpected swap-out")
        if not progressed:
            clock.advance(1.0)
    raise AssertionError(f"job did not finish: {job.snapshot()}")


def _planner() -> tuple[Planner, FakeClock]:
    clock = FakeClock()
    return Planner(clock, PlannerOptions(lease_epoch="e")), clock


# ---- spec ---------------------------------------------------------------------------------------------


def test_mode_defaults_for_binding_and_balancing() -> None:
    static = make_spec(pipeline={"mode": "static"})
    assert static.pipeline.effective_binding == "static" and static.balancing == "static"
    assert static.pipeline.barrier
    flex = make_spec(pipeline={"mode": "async"})
    assert flex.pipeline.effective_binding == "dynamic" and flex.balancing == "hierarchical"
    assert not flex.pipeline.barrier
    ablation = make_spec(pipeline={"mode": "async", "binding": "static"}, rollout={"balancing": "round-robin"})
    assert ablation.pipeline.effective_binding == "static" and ablation.balancing == "round-robin"
    assert make_spec(pipeline={"mode": "sequential"}).pipeline.barrier


@pytest.mark.parametrize(("sections", "message"), [
    ({"pipeline": {"mode": "static", "binding": "dynamic"}}, "pipeline.binding: mode 'static'"),
    ({"pipeline": {"mode": "static"}, "rollout": {"balancing": "hierarchical"}}, "rollout.balancing: mode 'static'"),
    ({"pipeline": {"binding": "fixed"}}, "pipeline.binding: must be one of 'dynamic' or 'static'"),
    ({"rollout": {"balancing": "random"}}, "rollout.balancing: must be one of"),
])
def test_contradictory_or_unknown_settings_are_rejected(sections: dict[str, Any], message: str) -> None:
    from flexmarl.jobspec import parse_job_spec

    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        parse_job_spec(spec_dict(**sections))


# ---- sequential -------------------------------------------------------------------------------------------


def test_sequential_trains_agents_one_after_another_after_the_whole_batch() -> None:
    planner, clock = _planner()
    planner.submit_job("job", make_spec(agents=THREE_AGENTS, pipeline={"mode": "sequential"}, total_steps=3))
    events = _drive(planner, clock, "job", slots=("s0", "s1", "s2"))
    assert planner.job("job").state is JobState.SUCCEEDED
    committed: set[tuple[str, int]] = set()
    leased_per_batch: dict[int, int] = {}
    names = ["a0", "a1", "a2"]
    for kind, _slot, item in events:
        if kind == "lease":
            batch = item.batch_index
            # Batch t + 1 only after every agent committed step t.
            assert all((name, batch - 1) in committed for name in names) or batch == 0
            leased_per_batch[batch] = leased_per_batch.get(batch, 0) + 1
        elif kind == "work":
            index = names.index(item.agent)
            # The whole batch first (barrier), then agent k only after agent k-1 committed the step.
            assert leased_per_batch.get(item.step) == 4
            assert index == 0 or (names[index - 1], item.step) in committed
            # No two agents' steps overlap: agent k+1's step has not started while agent k trains.
            assert index == len(names) - 1 or (names[index + 1], item.step) not in committed
        elif kind == "commit":
            committed.add((item.agent, item.step))
    assert committed == {(name, step) for name in names for step in range(3)}


def test_sequential_gates_demand_so_idle_slots_stay_idle() -> None:
    planner, clock = _planner()
    planner.submit_job("job", make_spec(agents=THREE_AGENTS, pipeline={"mode": "sequential"}, total_steps=1))
    job = planner.job("job")
    for lease in planner.lease_rollout_tasks("r", 10):
        planner.report_rollout_task(lease.lease_id, "r", lease.task_id, True, "",
                                    experiences_for(lease, job.spec.agent_names))
    assert job.demand("a0").has_work
    assert not job.demand("a1").has_work and not job.demand("a2").has_work
    assert job.agent_may_train("a0", 0) and not job.agent_may_train("a2", 0)
    # Three slots poll; only one of them gets work (a0's), the others stay idle.
    works = [planner.poll_trainer_work(f"w{i}", f"s{i}") for i in range(3)]
    assert [type(w).__name__ for w in works].count("MicroBatchWork") == 1
    assert {w.agent for w in works if w is not None} == {"a0"}


# ---- static and static binding ------------------------------------------------------------------------


@pytest.mark.parametrize(("slots", "expected"), [
    (("s0", "s1", "s2"), {"a0": {"s0"}, "a1": {"s1"}, "a2": {"s2"}}),
    (("s0", "s1"), {"a0": {"s0"}, "a1": {"s1"}, "a2": {"s0"}}),
    (("s0",), {"a0": {"s0"}, "a1": {"s0"}, "a2": {"s0"}}),
    (("s0", "s1", "s2", "s3", "s4", "s5"), {"a0": {"s0", "s3"}, "a1": {"s1", "s4"}, "a2": {"s2", "s5"}}),
])
def test_static_mode_keeps_each_agent_on_its_fixed_slot_set(slots: tuple[str, ...],
                                                             expected: dict[str, set[str]]) -> None:
    planner, clock = _planner()
    planner.submit_job("job", make_spec(agents=THREE_AGENTS, pipeline={"mode": "static"}, total_steps=2))
    for slot in slots:  # every slot known before the first decision
        planner.poll_trainer_work(f"trainer-{slot}", slot)
    events = _drive(planner, clock, "job", slots=slots)
    assert planner.job("job").state is JobState.SUCCEEDED
    used: dict[str, set[str]] = {}
    for kind, slot, item in events:
        if kind == "work":
            used.setdefault(item.agent, set()).add(slot)
            assert slot in expected[item.agent]
    assert set(used) == {"a0", "a1", "a2"}


def test_static_mode_is_a_barrier() -> None:
    planner, clock = _planner()
    planner.submit_job("job", make_spec(pipeline={"mode": "static", "max_staleness": 2}, total_steps=2))
    job = planner.job("job")
    assert job.admission_limit() == job.spec.batch.prompts_per_step  # eta ignored: on-policy
    leases = planner.lease_rollout_tasks("r", 10)
    assert len(leases) == 4
    for lease in leases[:3]:
        planner.report_rollout_task(lease.lease_id, "r", lease.task_id, True, "",
                                    experiences_for(lease, job.spec.agent_names))
    assert planner.poll_trainer_work("w0", "s0") is None  # 2 complete micro-batches' worth, but no barrier yet


@pytest.mark.parametrize(("pipeline", "expected"), [
    ({"mode": "async", "max_staleness": 8, "step_fill": "completion"}, 36),
    ({"mode": "async", "max_staleness": 2}, 12),
    ({"mode": "sync", "max_staleness": 2}, 4),
])
def test_rollout_tasks_ahead_is_what_a_worker_can_lease_at_once(pipeline: dict[str, Any], expected: int) -> None:
    """The spec's figure (rolloutd's --max-tasks a job needs) is exactly the admission a fresh job grants."""
    planner, _ = _planner()
    planner.submit_job("job", make_spec(pipeline=pipeline, total_steps=20))
    job = planner.job("job")
    assert job.spec.rollout_tasks_ahead == expected
    assert len(planner.lease_rollout_tasks("r", 1000)) == expected


def test_static_binding_ablation_keeps_async_pipelining() -> None:
    planner, clock = _planner()
    planner.submit_job("job", make_spec(pipeline={"mode": "async", "binding": "static"}, total_steps=1))
    job = planner.job("job")
    for slot in ("s0", "s1"):
        planner.poll_trainer_work(f"w-{slot}", slot)
    leases = planner.lease_rollout_tasks("r", 10)
    for lease in leases[:2]:  # half the batch: one micro-batch per agent is complete
        planner.report_rollout_task(lease.lease_id, "r", lease.task_id, True, "",
                                    experiences_for(lease, job.spec.agent_names))
    # s1 may only serve the receiver (agent 1), s0 only the sender; both get work before the batch ends.
    w1 = planner.poll_trainer_work("w-s1", "s1")
    w0 = planner.poll_trainer_work("w-s0", "s0")
    assert isinstance(w1, MicroBatchWork) and w1.agent == "receiver"
    assert isinstance(w0, MicroBatchWork) and w0.agent == "sender"


def test_dynamic_binding_lets_any_slot_serve_any_agent() -> None:
    planner, clock = _planner()
    planner.submit_job("job", make_spec(pipeline={"mode": "async"}, total_steps=1))
    job = planner.job("job")
    for slot in ("s0", "s1"):
        planner.poll_trainer_work(f"w-{slot}", slot)
    for lease in planner.lease_rollout_tasks("r", 10)[:2]:
        planner.report_rollout_task(lease.lease_id, "r", lease.task_id, True, "",
                                    experiences_for(lease, job.spec.agent_names))
    w1 = planner.poll_trainer_work("w-s1", "s1")
    assert isinstance(w1, MicroBatchWork) and w1.agent == "receiver"  # ties go to the smallest key
    w0 = planner.poll_trainer_work("w-s0", "s0")
    assert isinstance(w0, MicroBatchWork) and w0.agent == "sender"


def test_static_binding_follows_a_slot_death() -> None:
    planner, clock = _planner()
    planner.submit_job("job", make_spec(pipeline={"mode": "static"}, total_steps=2))
    for slot in ("s0", "s1"):
        planner.poll_trainer_work(f"trainer-{slot}", slot)
    planner.worker_gone("trainer-s1")  # one slot left: both agents may use it
    events = _drive(planner, clock, "job", slots=("s0",))
    assert planner.job("job").state is JobState.SUCCEEDED
    assert {item.agent for kind, _s, item in events if kind == "work"} == {"sender", "receiver"}


@pytest.mark.parametrize("mode", ["async", "sync", "sequential", "static"])
def test_every_mode_trains_the_same_manifests(mode: str) -> None:
    reference, ref_clock = _planner()
    reference.submit_job("job", make_spec(pipeline={"mode": "async"}, total_steps=2))
    run_job(reference, ref_clock, "job", slots=("s0", "s1"))
    planner, clock = _planner()
    planner.submit_job("job", make_spec(pipeline={"mode": mode}, total_steps=2))
    run_job(planner, clock, "job", slots=("s0", "s1"))
    assert planner.job("job").state is JobState.SUCCEEDED
    for agent in ("sender", "receiver"):
        for step in range(2):
            assert planner.job("job").manifest(agent, step) == reference.job("job").manifest(agent, step)
