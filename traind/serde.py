"""Proto <-> domain conversions for traind: the only module of the daemon that builds or reads messages."""

from __future__ import annotations

from collections.abc import Sequence

from flexmarl import weight_group
from flexmarl.v1 import orchestrator_pb2, train_pb2
from flexmarl.weight_group import WeightGroupRecord
from traind.work import (
    DataParallelGroup,
    MicroBatchWork,
    OptimizerStepWork,
    ResidentAgent,
    SlotEvent,
    SlotEventKind,
    SlotStatus,
    StepCommit,
    SwapOutWork,
    TrainerWork,
    WarmStartWork,
)

_SLOT_EVENT_KINDS = {
    SlotEventKind.SWAPPED_OUT: orchestrator_pb2.ReportSlotEventRequest.KIND_SWAPPED_OUT,
    SlotEventKind.FAILED: orchestrator_pb2.ReportSlotEventRequest.KIND_FAILED,
}
#: ReportSlotEvent's error field is bounded (orchestratord rejects longer ones).
MAX_ERROR_CHARS = 4096


def poll_request(worker_id: str, slot_id: str, resident: Sequence[ResidentAgent], wait_ms: int,
                 dp_address: str, capacity: float = 1.0) -> orchestrator_pb2.PollTrainerWorkRequest:
    """A slot's poll for work."""
    return orchestrator_pb2.PollTrainerWorkRequest(
        worker_id=worker_id, slot_id=slot_id, wait_ms=wait_ms, dp_address=dp_address, capacity=capacity,
        resident=[orchestrator_pb2.ResidentAgent(job_id=r.job_id, agent=r.agent, version=r.version) for r in resident])


def data_parallel_group(msg: orchestrator_pb2.DataParallelGroup) -> DataParallelGroup:
    """A work's data-parallel group."""
    return DataParallelGroup(group_id=msg.group_id, rank=msg.rank, world_size=msg.world_size,
                             master_address=msg.master_address, member_slot_ids=tuple(msg.member_slot_ids),
                             timeout_s=msg.timeout_s)


def micro_batch_work(msg: orchestrator_pb2.MicroBatchWork) -> MicroBatchWork:
    """A leased micro-batch."""
    return MicroBatchWork(
        lease_id=msg.lease_id, job_id=msg.job_id, agent=msg.agent, step=msg.step, step_id=msg.step_id,
        micro_batch_index=msg.micro_batch_index, experience_ids=tuple(msg.experience_ids),
        base_version=msg.base_version, state_uri=msg.state_uri, step_episodes=msg.step_episodes,
        spec_digest=msg.spec_digest, group=data_parallel_group(msg.group) if msg.HasField("group") else None,
        step_return_count=msg.step_return_count, step_return_mean=msg.step_return_mean,
        step_return_std=msg.step_return_std)


def optimizer_step_work(msg: orchestrator_pb2.OptimizerStepWork) -> OptimizerStepWork:
    """An optimizer step to take."""
    return OptimizerStepWork(
        job_id=msg.job_id, agent=msg.agent, step=msg.step, step_id=msg.step_id, new_version=msg.new_version,
        step_response_tokens=msg.step_response_tokens, step_episodes=msg.step_episodes,
        num_micro_batches=msg.num_micro_batches, base_version=msg.base_version, state_uri=msg.state_uri,
        spec_digest=msg.spec_digest, group=data_parallel_group(msg.group) if msg.HasField("group") else None,
        step_sequences=msg.step_sequences)


def trainer_work(reply: orchestrator_pb2.PollTrainerWorkResponse) -> TrainerWork | None:
    """A poll's work (None: nothing to do yet)."""
    kind = reply.WhichOneof("work")
    if kind == "micro_batch":
        return micro_batch_work(reply.micro_batch)
    if kind == "optimizer_step":
        return optimizer_step_work(reply.optimizer_step)
    if kind == "swap_out":
        return SwapOutWork(job_id=reply.swap_out.job_id, agent=reply.swap_out.agent, location=reply.swap_out.location)
    if kind == "warm_start":
        warm = reply.warm_start
        return WarmStartWork(lease_id=warm.lease_id, job_id=warm.job_id, agent=warm.agent,
                             spec_digest=warm.spec_digest)
    return None


def ack_request(worker_id: str, slot_id: str, lease_id: str, episodes: int) -> orchestrator_pb2.AckMicroBatchRequest:
    """The ack of a micro-batch whose gradient is accumulated."""
    return orchestrator_pb2.AckMicroBatchRequest(lease_id=lease_id, worker_id=worker_id, slot_id=slot_id,
                                                 episodes=episodes)


def renew_request(worker_id: str, lease_ids: Sequence[str],
                  progress: Sequence[int] = ()) -> orchestrator_pb2.RenewLeasesRequest:
    """A renewal of the leases a slot is working on (a micro-batch's, a warm start's), with their progress."""
    return orchestrator_pb2.RenewLeasesRequest(worker_id=worker_id, lease_ids=list(lease_ids), progress=list(progress))


def commit_request(worker_id: str, commit: StepCommit) -> orchestrator_pb2.CommitStepRequest:
    """A committed step."""
    return orchestrator_pb2.CommitStepRequest(
        worker_id=worker_id, slot_id=commit.slot_id, job_id=commit.job_id, agent=commit.agent, step=commit.step,
        new_version=commit.new_version, weights_uri=commit.weights_uri, state_uri=commit.state_uri,
        loss=commit.loss, grad_norm=commit.grad_norm, step_seconds=commit.step_seconds, figures=dict(commit.figures))


def announce_request(worker_id: str, slot_id: str, job_id: str, agent: str, version: int,
                     record: WeightGroupRecord) -> orchestrator_pb2.AnnounceWeightsRequest:
    """A version about to be broadcast over a weight-update group."""
    return orchestrator_pb2.AnnounceWeightsRequest(worker_id=worker_id, slot_id=slot_id, job_id=job_id, agent=agent,
                                                   version=version, weight_group=weight_group.to_message(record))


def slot_event_request(worker_id: str, event: SlotEvent) -> orchestrator_pb2.ReportSlotEventRequest:
    """A slot event (the error is cut to what orchestratord accepts)."""
    return orchestrator_pb2.ReportSlotEventRequest(
        worker_id=worker_id, slot_id=event.slot_id, job_id=event.job_id, agent=event.agent,
        kind=_SLOT_EVENT_KINDS[event.kind], state_uri=event.state_uri, error=event.error[:MAX_ERROR_CHARS])


def slot_status(status: SlotStatus) -> train_pb2.SlotStatus:
    """One slot of GetTrainerStatus."""
    resident = status.resident
    return train_pb2.SlotStatus(
        slot_id=status.slot_id, device=status.device, memory_bytes=status.memory_bytes,
        resident=f"{resident.job_id}/{resident.agent}" if resident is not None else "",
        resident_version=resident.version if resident is not None else 0, busy=status.busy,
        busy_fraction=status.busy_fraction, dp_group_id=status.dp_group_id, dp_rank=status.dp_rank,
        dp_world_size=status.dp_world_size, capacity=status.capacity)


def trainer_status(worker_id: str, slots: Sequence[SlotStatus]) -> train_pb2.TrainerStatus:
    """GetTrainerStatus' reply."""
    return train_pb2.TrainerStatus(worker_id=worker_id, slots=[slot_status(s) for s in slots])
