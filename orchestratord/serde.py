"""Proto <-> domain conversions for orchestratord (the servicer itself builds only one-field replies).

The reported experiences become :class:`flexmarl.experience.ExperienceSummary` here
(:func:`experience_summaries`), the one decoder of the proto ``ExperienceSummary``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flexmarl import weight_group
from flexmarl.errors import InvalidArgument
from flexmarl.evaluation import EvalEpisode, EvalRecord
from flexmarl.experience import ExperienceSummary, FailedEpisode
from flexmarl.v1 import common_pb2, orchestrator_pb2, rollout_pb2
from flexmarl.weight_group import WeightGroupRecord
from orchestratord.binding import DataParallelGroup
from orchestratord.planner import (
    AgentVersion,
    JobSnapshot,
    MicroBatchWork,
    OptimizerStepWork,
    RenewResult,
    ResidentAgent,
    RolloutTaskLease,
    SlotEventKind,
    SwapOutWork,
    TrainerWork,
    WarmStartWork,
)
from orchestratord.state import JobState

_SLOT_EVENT_KINDS: dict[int, SlotEventKind] = {
    orchestrator_pb2.ReportSlotEventRequest.KIND_SWAPPED_OUT: SlotEventKind.SWAPPED_OUT,
    orchestrator_pb2.ReportSlotEventRequest.KIND_FAILED: SlotEventKind.FAILED,
}


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def job_status(snap: JobSnapshot, tokens_per_s: Mapping[str, float] | None = None) -> orchestrator_pb2.JobStatus:
    """A planner snapshot as a JobStatus message (tokens_per_s: last step's rate per agent)."""
    return orchestrator_pb2.JobStatus(
        job_id=snap.job_id,
        state=int(snap.state),  # type: ignore[arg-type]
        name=snap.name,
        agents=[
            orchestrator_pb2.AgentProgress(
                agent=a.agent, step=a.version, version=a.version, total_steps=a.total_steps,
                reward_mean=a.reward_mean, staleness_mean=a.staleness_mean, weights_uri=a.weights_uri,
                slot_id=a.slot_id, step_seconds=a.step_seconds,
                tokens_per_s=(tokens_per_s or {}).get(a.agent, 0.0), slot_ids=list(a.slot_ids),
                return_mean=a.return_mean, initial_weights_uri=a.initial_weights_uri,
            )
            for a in snap.agents
        ],
        error=snap.error,
        created_unix_ms=_ms(snap.created_s),
        updated_unix_ms=_ms(snap.updated_s),
        spec_json=snap.spec_json,
        spec_digest=snap.spec_digest,
        tasks_done=snap.tasks_done,
        tasks_total=snap.tasks_total,
        episodes_failed=snap.episodes_failed,
        tasks_given_up=snap.tasks_given_up,
        last_episode_failure=snap.last_episode_failure,
    )


def agent_version(v: AgentVersion) -> common_pb2.AgentVersion:
    """An agent version message."""
    return common_pb2.AgentVersion(job_id=v.job_id, agent=v.agent, version=v.version, weights_uri=v.weights_uri)


def announced_version(v: AgentVersion, record: WeightGroupRecord) -> common_pb2.AgentVersion:
    """A version being broadcast: no weights_uri yet, its weight-update group."""
    return common_pb2.AgentVersion(job_id=v.job_id, agent=v.agent, version=v.version,
                                   weight_group=weight_group.to_message(record))


def weight_group_record(msg: orchestrator_pb2.AnnounceWeightsRequest) -> WeightGroupRecord:
    """The group an AnnounceWeights request names; raises InvalidArgument for a malformed one."""
    if not msg.HasField("weight_group"):
        raise InvalidArgument("weight_group: required")
    return weight_group.from_message(msg.weight_group)


def rollout_task(task: RolloutTaskLease, spec_digest: str) -> orchestrator_pb2.RolloutTask:
    """A leased task as a RolloutTask message."""
    return orchestrator_pb2.RolloutTask(
        lease_id=task.lease_id, job_id=task.job_id, task_id=task.task_id, task_index=task.task_index,
        batch_index=task.batch_index, group_size=task.group_size,
        agent_versions=[agent_version(v) for v in task.agent_versions],
        deadline_unix_ms=_ms(task.deadline_s), attempt=task.attempt, spec_digest=spec_digest,
        evaluation=task.evaluation, greedy=task.greedy, pinned=task.pinned, eval_file=task.eval_file,
        eval_sha256=task.eval_sha256,
    )


def renew_response(result: RenewResult) -> orchestrator_pb2.RenewLeasesResponse:
    """A renewal's outcome as a RenewLeasesResponse."""
    return orchestrator_pb2.RenewLeasesResponse(lost_lease_ids=list(result.lost_lease_ids),
                                                deadline_unix_ms=_ms(result.deadline_s))


def experience_summaries(msgs: Iterable[orchestrator_pb2.ExperienceSummary]) -> list[ExperienceSummary]:
    """Reported experiences (the one proto -> :class:`flexmarl.experience.ExperienceSummary` decoder)."""
    return [
        ExperienceSummary(m.experience_id, m.agent, m.group_id, m.sample_index, m.behavior_version,
                          m.response_tokens, m.reward,
                          m.episode_return if m.HasField("episode_return") else None)
        for m in msgs
    ]


def failed_episodes(msgs: Iterable[orchestrator_pb2.FailedEpisode]) -> list[FailedEpisode]:
    """A task's reported failed episodes (reasons cut to 1000 characters; the planner checks the indices)."""
    return [FailedEpisode(m.sample_index, m.reason[:1000]) for m in msgs]


def eval_episodes(msgs: Iterable[orchestrator_pb2.EvalEpisode]) -> list[EvalEpisode]:
    """An eval task's reported episodes (the planner checks them against its round)."""
    return [
        EvalEpisode(task_index=m.task_index, sample_index=m.sample_index, returns=dict(m.returns),
                    team_success=m.team_success if m.has_team_success else None,
                    versions={v.agent: tuple(v.versions) for v in m.versions}, role_correct=dict(m.role_correct))
        for m in msgs
    ]


def eval_record(row: dict[str, Any]) -> orchestrator_pb2.EvalRecord:
    """A stored evaluation round as an EvalRecord message."""
    record = EvalRecord.from_dict(row)

    def scores(s: Any) -> orchestrator_pb2.EvalScores:
        return orchestrator_pb2.EvalScores(reward_mean=s.reward_mean, success=s.success, pass_at_k=s.pass_at_k,
                                           episodes=s.episodes)

    return orchestrator_pb2.EvalRecord(
        version=record.version, tasks=record.tasks, samples_per_task=record.samples_per_task,
        failed_tasks=record.failed_tasks, sampling=record.sampling, team=scores(record.team),
        agents=[orchestrator_pb2.EvalAgentScores(agent=a.agent, version=a.version, versions_seen=list(a.versions_seen),
                                                 scores=scores(a.scores)) for a in record.agents],
        team_success_from_env=record.team_success_from_env, finished_unix_ms=record.finished_unix_ms,
        round_id=record.round_id, eval_file=record.eval_file, role_correct=dict(record.role_correct),
    )


def resident_agents(msgs: Iterable[orchestrator_pb2.ResidentAgent]) -> list[ResidentAgent]:
    """Agents a slot reports as resident."""
    return [ResidentAgent(m.job_id, m.agent, m.version) for m in msgs]


def job_states(values: Iterable[int]) -> list[JobState]:
    """ListJobs' state filter; raises InvalidArgument on an unknown state."""
    states = []
    for value in values:
        try:
            states.append(JobState(value))
        except ValueError:
            raise InvalidArgument(f"states: unknown job state {value}") from None
    return states


def slot_event_kind(value: int) -> SlotEventKind:
    """ReportSlotEvent's kind; raises InvalidArgument on an unknown or unset kind."""
    kind = _SLOT_EVENT_KINDS.get(value)
    if kind is None:
        raise InvalidArgument(f"kind: unknown slot event {value}")
    return kind


def dp_group(group: DataParallelGroup | None, rank: int) -> orchestrator_pb2.DataParallelGroup | None:
    """A step attempt's data-parallel group as seen by one member (None when it trains alone)."""
    if group is None or group.world_size <= 1:
        return None
    return orchestrator_pb2.DataParallelGroup(
        group_id=group.group_id, rank=rank, world_size=group.world_size, master_address=group.master_address,
        member_slot_ids=list(group.members), timeout_s=group.timeout_s)


def _step_returns(stats: tuple[int, float, float] | None) -> dict[str, Any]:
    """MicroBatchWork's step_return_* fields (none set when the agent needs no step statistics)."""
    if stats is None:
        return {}
    return {"step_return_count": stats[0], "step_return_mean": stats[1], "step_return_std": stats[2]}


def trainer_work(work: TrainerWork | None, spec_digest: str) -> orchestrator_pb2.PollTrainerWorkResponse:
    """Trainer work as the oneof of PollTrainerWorkResponse (empty when None)."""
    if isinstance(work, MicroBatchWork):
        return orchestrator_pb2.PollTrainerWorkResponse(micro_batch=orchestrator_pb2.MicroBatchWork(
            lease_id=work.lease_id, job_id=work.job_id, agent=work.agent, step=work.step, step_id=work.step_id,
            micro_batch_index=work.micro_batch_index, experience_ids=list(work.experience_ids),
            base_version=work.base_version, state_uri=work.state_uri, step_episodes=work.step_episodes,
            deadline_unix_ms=_ms(work.deadline_s), spec_digest=spec_digest, group=dp_group(work.group, work.rank),
            **_step_returns(work.step_returns),
        ))
    if isinstance(work, OptimizerStepWork):
        return orchestrator_pb2.PollTrainerWorkResponse(optimizer_step=orchestrator_pb2.OptimizerStepWork(
            job_id=work.job_id, agent=work.agent, step=work.step, step_id=work.step_id,
            new_version=work.new_version, step_response_tokens=work.step_response_tokens,
            step_episodes=work.step_episodes, num_micro_batches=work.num_micro_batches,
            group=dp_group(work.group, work.rank), base_version=work.base_version, state_uri=work.state_uri,
            spec_digest=spec_digest, step_sequences=work.step_sequences,
        ))
    if isinstance(work, SwapOutWork):
        return orchestrator_pb2.PollTrainerWorkResponse(swap_out=orchestrator_pb2.SwapOutWork(
            job_id=work.job_id, agent=work.agent, location=work.location,
        ))
    if isinstance(work, WarmStartWork):
        return orchestrator_pb2.PollTrainerWorkResponse(warm_start=orchestrator_pb2.WarmStartWork(
            lease_id=work.lease_id, job_id=work.job_id, agent=work.agent, spec_digest=spec_digest,
            deadline_unix_ms=_ms(work.deadline_s),
        ))
    return orchestrator_pb2.PollTrainerWorkResponse()


def agent_demand_request(demand: Mapping[tuple[str, str], int]) -> rollout_pb2.SetAgentDemandRequest:
    """Each (job, agent)'s outstanding generation tokens as rolloutd's balancer hint (negative -> 0)."""
    return rollout_pb2.SetAgentDemandRequest(demand=[
        rollout_pb2.AgentDemand(job_id=job_id, agent=agent, tokens=max(0, tokens))
        for (job_id, agent), tokens in sorted(demand.items())
    ])


def step_record(row: dict[str, Any]) -> orchestrator_pb2.StepRecord:
    """A stored history row as a StepRecord."""
    fields = orchestrator_pb2.StepRecord.DESCRIPTOR.fields_by_name
    figures = {k: float(v) for k, v in row.items()
               if k not in fields and isinstance(v, int | float) and not isinstance(v, bool)}
    return orchestrator_pb2.StepRecord(**{k: v for k, v in row.items() if k in fields and k != "figures"},
                                       figures=figures)
