"""Shared fixtures for orchestratord domain tests: a fake clock, specs and a fake rollout/trainer."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from flexmarl.experience import ExperienceSummary
from flexmarl.jobspec import JobSpec, parse_job_spec
from orchestratord.planner import (
    MicroBatchWork,
    OptimizerStepWork,
    Planner,
    RolloutTaskLease,
    SlotEventKind,
    SwapOutWork,
)

BASE_SPEC: dict[str, Any] = {
    "name": "signaling",
    "seed": 0,
    "environment": {"entrypoint": "examples.signaling.env:SignalingGame", "config": {}},
    "agents": [
        {"name": "sender", "model": "/models/tiny"},
        {"name": "receiver", "model": "/models/tiny"},
    ],
    "algorithm": {"name": "grpo"},
    "batch": {"prompts_per_step": 4, "group_size": 2, "micro_batch_size": 4},
    "total_steps": 3,
    "pipeline": {"mode": "async", "max_staleness": 0},
    "leases": {"rollout_timeout_s": 10, "train_timeout_s": 20},
}


class FakeClock:
    def __init__(self, start_s: float = 1_000.0) -> None:
        self.now = start_s

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def spec_dict(**sections: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE_SPEC)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    return data


def make_spec(**sections: Any) -> JobSpec:
    return parse_job_spec(spec_dict(**sections))


def tokens_of(task_id: str, sample: int, agent: str) -> int:
    return 1 + (sum(map(ord, f"{task_id}/{sample}/{agent}")) % 7)


def experiences_for(lease: RolloutTaskLease, agents: Sequence[str], *, turns: int = 1,
                    versions: dict[str, int] | None = None) -> list[ExperienceSummary]:
    """A complete report: every agent acts `turns` times in each of the group's episodes."""
    given = {v.agent: v.version for v in lease.agent_versions}
    out: list[ExperienceSummary] = []
    for sample in range(lease.group_size):
        for agent in agents:
            for turn in range(turns):
                out.append(ExperienceSummary(
                    experience_id=f"{lease.task_id}/{sample}/{agent}/{turn}", agent=agent,
                    group_id=f"{lease.task_id}/{agent}", sample_index=sample,
                    behavior_version=(versions or given)[agent],
                    response_tokens=tokens_of(lease.task_id, sample, agent), reward=float(sample)))
    return out


def run_job(planner: Planner, clock: FakeClock, job_id: str, *, slots: Sequence[str] = ("slot-0",),
            rollout_workers: int = 2, max_rounds: int = 10_000) -> list[tuple[str, object]]:
    """Drives a job to its end with healthy workers; returns the trace of trainer work."""
    job = planner.job(job_id)
    agents = job.spec.agent_names
    trace: list[tuple[str, object]] = []
    for _ in range(max_rounds):
        if job.state.terminal:
            return trace
        progressed = False
        for w in range(rollout_workers):
            for lease in planner.lease_rollout_tasks(f"roll-{w}", 2):
                planner.report_rollout_task(lease.lease_id, f"roll-{w}", lease.task_id, True, "",
                                            experiences_for(lease, agents))
                progressed = True
        for slot in slots:
            work = planner.poll_trainer_work(f"trainer-{slot}", slot)
            if work is None:
                continue
            progressed = True
            trace.append((slot, work))
            if isinstance(work, MicroBatchWork):
                planner.ack_micro_batch(work.lease_id, f"trainer-{slot}", slot)
            elif isinstance(work, OptimizerStepWork):
                planner.commit_step(f"trainer-{slot}", slot, work.job_id, work.agent, work.step, work.new_version,
                                    f"file:///w/{work.agent}/{work.new_version}",
                                    f"file:///s/{work.agent}/{work.new_version}")
            elif isinstance(work, SwapOutWork):
                planner.report_slot_event(f"trainer-{slot}", slot, work.job_id, work.agent,
                                          SlotEventKind.SWAPPED_OUT, f"stored://state/{work.agent}")
        if not progressed:
            clock.advance(1.0)
    raise AssertionError(f"job did not finish: {job.snapshot()}")


def train_to_version(planner: Planner, job_id: str, version: int, *, slots: Sequence[str] = ("slot-0", "slot-1"),
                     max_rounds: int = 100) -> None:
    """Polls the slots, acking micro-batches and committing steps, until every agent of the job is at ``version``."""
    job = planner.job(job_id)
    for _ in range(max_rounds):
        if min(job.version(a) for a in job.spec.agent_names) >= version:
            return
        for slot in slots:
            work = planner.poll_trainer_work("t", slot)
            if isinstance(work, MicroBatchWork):
                planner.ack_micro_batch(work.lease_id, "t", slot)
            elif isinstance(work, OptimizerStepWork):
                planner.commit_step("t", slot, job_id, work.agent, work.step, work.new_version,
                                    f"file:///w/{work.agent}/{work.new_version}", f"file:///s/{work.agent}")
    raise AssertionError(f"job {job_id} did not reach version {version}: {job.snapshot()}")
