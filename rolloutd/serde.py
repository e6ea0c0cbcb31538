"""Proto <-> domain conversions for rolloutd: the only module of the daemon that builds or reads messages."""

from __future__ import annotations

from collections.abc import Sequence

from flexmarl import weight_group
from flexmarl.client import JobState
from flexmarl.errors import InvalidArgument
from flexmarl.evaluation import EvalEpisode
from flexmarl.experience import ExperienceSummary
from flexmarl.ids import EvalTaskRef, TaskRef
from flexmarl.v1 import common_pb2, orchestrator_pb2, rollout_pb2
from rolloutd.types import (
    ActiveJob,
    AgentDemand,
    AgentVersion,
    PublishedVersion,
    RenewResult,
    RolloutStatus,
    RolloutTask,
    TaskReport,
)

#: Most demand hints one SetAgentDemand may carry.
MAX_DEMAND_ENTRIES = 4096
#: Longest error text a report carries (the rest is cut).
MAX_REPORT_ERROR_CHARS = 4096

# ---- orchestratord ---------------------------------------------------------------------------


def lease_request(worker_id: str, max_tasks: int, wait_ms: int) -> orchestrator_pb2.LeaseRolloutTasksRequest:
    """A LeaseRolloutTasks request."""
    return orchestrator_pb2.LeaseRolloutTasksRequest(worker_id=worker_id, max_tasks=max_tasks, wait_ms=wait_ms)


def rollout_task(msg: orchestrator_pb2.RolloutTask) -> RolloutTask:
    """A leased task; raises InvalidArgument when its task id is malformed or names another job."""
    ref: TaskRef | EvalTaskRef = EvalTaskRef.parse(msg.task_id) if msg.evaluation else TaskRef.parse(msg.task_id)
    if msg.job_id != ref.job_id:
        raise InvalidArgument(f"task {msg.task_id!r} leased for job {msg.job_id!r}")
    return RolloutTask(
        lease_id=msg.lease_id, ref=ref, task_index=msg.task_index, group_size=msg.group_size,
        attempt=msg.attempt, spec_digest=msg.spec_digest,
        agent_versions=tuple(AgentVersion(v.agent, v.version, v.weights_uri) for v in msg.agent_versions),
        evaluation=msg.evaluation, greedy=msg.greedy, pinned=msg.pinned, eval_file=msg.eval_file,
        eval_sha256=msg.eval_sha256,
    )


def renew_request(worker_id: str, lease_ids: Sequence[str],
                  progress: Sequence[int] = ()) -> orchestrator_pb2.RenewLeasesRequest:
    """A RenewLeases request (``progress``: empty, or each task's figure)."""
    return orchestrator_pb2.RenewLeasesRequest(worker_id=worker_id, lease_ids=list(lease_ids), progress=list(progress))


def renew_result(msg: orchestrator_pb2.RenewLeasesResponse) -> RenewResult:
    """The leases a renewal says are lost."""
    return RenewResult(frozenset(msg.lost_lease_ids))


def watch_versions_request(job_id: str, worker_id: str = "") -> orchestrator_pb2.WatchAgentVersionsRequest:
    """A WatchAgentVersions request for one job (by a peer of its weight-update groups when ``worker_id``)."""
    return orchestrator_pb2.WatchAgentVersionsRequest(job_id=job_id, worker_id=worker_id)


def published_version(msg: common_pb2.AgentVersion) -> PublishedVersion:
    """A streamed agent version, announced (with its weight-update group) or committed.

    Raises:
        InvalidArgument: A negative version or a malformed group.
    """
    if msg.version < 0:
        raise InvalidArgument(f"agent {msg.agent!r} of job {msg.job_id!r}: negative version {msg.version}")
    group = weight_group.from_message(msg.weight_group) if msg.HasField("weight_group") else None
    return PublishedVersion(msg.job_id, msg.agent, msg.version, msg.weights_uri, group)


def experience_summary(summary: ExperienceSummary) -> orchestrator_pb2.ExperienceSummary:
    """An experience summary message."""
    return orchestrator_pb2.ExperienceSummary(
        experience_id=summary.experience_id, agent=summary.agent, group_id=summary.group_id,
        sample_index=summary.sample_index, behavior_version=summary.behavior_version,
        response_tokens=summary.response_tokens, reward=summary.reward, episode_return=summary.episode_return,
    )


def eval_episode(episode: EvalEpisode) -> orchestrator_pb2.EvalEpisode:
    """An eval episode message."""
    return orchestrator_pb2.EvalEpisode(
        task_index=episode.task_index, sample_index=episode.sample_index, returns=dict(episode.returns),
        has_team_success=episode.team_success is not None, team_success=bool(episode.team_success),
        versions=[orchestrator_pb2.AgentVersionsSeen(agent=agent, versions=list(versions))
                  for agent, versions in sorted(episode.versions.items())],
        role_correct=dict(episode.role_correct),
    )


def report_request(worker_id: str, report: TaskReport) -> orchestrator_pb2.ReportRolloutTaskRequest:
    """A ReportRolloutTask request (the error cut to :data:`MAX_REPORT_ERROR_CHARS`)."""
    return orchestrator_pb2.ReportRolloutTaskRequest(
        lease_id=report.lease_id, worker_id=worker_id, task_id=report.task_id, succeeded=report.succeeded,
        error=report.error[:MAX_REPORT_ERROR_CHARS],
        experiences=[experience_summary(e) for e in report.experiences], reason=str(report.reason),
        eval_episodes=[eval_episode(e) for e in report.eval_episodes],
        failed_episodes=[orchestrator_pb2.FailedEpisode(sample_index=f.sample_index, reason=f.reason)
                         for f in report.failed_episodes],
    )


def active_jobs_request() -> orchestrator_pb2.ListJobsRequest:
    """A ListJobs request for the jobs whose tasks may still come: pending and running."""
    return orchestrator_pb2.ListJobsRequest(states=[orchestrator_pb2.JOB_STATE_PENDING,
                                                    orchestrator_pb2.JOB_STATE_RUNNING])


def active_jobs(msg: orchestrator_pb2.ListJobsResponse) -> list[ActiveJob]:
    """The listed jobs' ids and spec digests."""
    return [ActiveJob(job.job_id, job.spec_digest) for job in msg.jobs]


def job_request(job_id: str) -> orchestrator_pb2.GetJobRequest:
    """A GetJob request."""
    return orchestrator_pb2.GetJobRequest(job_id=job_id)


def job_state(msg: orchestrator_pb2.JobStatus) -> JobState:
    """A job's state; raises InvalidArgument for a state this version does not know."""
    try:
        return JobState(msg.state) if msg.state else JobState.PENDING
    except ValueError:
        raise InvalidArgument(f"job {msg.job_id!r}: unknown state {msg.state}") from None


def job_spec_json(msg: orchestrator_pb2.JobStatus) -> str:
    """A job's spec JSON."""
    return str(msg.spec_json)


# ---- rolloutd's own API ----------------------------------------------------------------------


def agent_demand(msg: rollout_pb2.SetAgentDemandRequest) -> list[AgentDemand]:
    """The demand hints of a SetAgentDemand request; raises InvalidArgument on a malformed one."""
    if len(msg.demand) > MAX_DEMAND_ENTRIES:
        raise InvalidArgument(f"demand: more than {MAX_DEMAND_ENTRIES} entries")
    for entry in msg.demand:
        if not entry.job_id or not entry.agent:
            raise InvalidArgument("demand: job_id and agent must not be empty")
    return [AgentDemand(entry.job_id, entry.agent, entry.tokens) for entry in msg.demand]


def rollout_status(status: RolloutStatus) -> rollout_pb2.RolloutStatus:
    """A RolloutStatus message."""
    return rollout_pb2.RolloutStatus(
        worker_id=status.worker_id, tasks_in_flight=status.tasks_in_flight, episodes_done=status.episodes_done,
        reassignments=status.reassignments,
        replicas=[
            rollout_pb2.ReplicaStatus(
                replica_id=r.replica_id, url=r.url, agents=list(r.agents), healthy=r.healthy,
                outstanding_tokens=r.outstanding_tokens, in_flight_requests=r.in_flight_requests, backend=r.backend,
            )
            for r in status.replicas
        ],
        jobs=[rollout_pb2.JobPreparation(job_id=j.job_id, state=j.state, error=j.error, seconds=j.seconds)
              for j in status.jobs],
        max_tasks=status.max_tasks, max_tasks_auto=status.max_tasks_auto, live_rolloutds=status.live_rolloutds,
    )
