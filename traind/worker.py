"""traind's worker loop: each slot pulls work from orchestratord and trains the agent bound to it.

A slot holds at most one agent's DeepSpeed engine. Work comes as micro-batches
(accumulate gradients), an optimizer step (scale by the step's fixed normaliser, step,
publish the weights, save the full state, then CommitStep) or a swap-out. After every
commit the agent's full training state is saved to the configured location
(``file://`` under the work dir by default, ``stored://`` for clusters without shared
storage, ``mem://`` to keep it in this process), so a step of a dead slot replays from
the last committed state on any slot that can read that location.
Beside each committed durable state a small manifest names the version (job, agent, weights,
state, spec; :mod:`flexmarl.checkpoints`), so another cluster can resume the job from it alone;
it is pruned with the state.

Data parallelism: a traind process with one slot (the GPU deployment: one process per
device) whose states are durable (``state_location`` file or stored) advertises a
rendezvous address (``dp_address``) in its polls. When orchestratord binds the slot into
an agent's group, the work carries the group (id, rank, world size, rank 0's address,
timeout): the process releases its engine, re-initialises its process group
(:func:`traind.distributed.join_group`), builds the engine from the agent's committed
state and accumulates its share of the step. Every member runs the optimizer step with
the step's normalisers; only rank 0 publishes, saves and commits (ZeRO 0 only: rank 0's
checkpoint holds the whole state). A member that leaves a group, or whose work fails,
drops its engine and becomes a world of one again.

Devices: on CUDA each slot has one device (``TrainerSettings.slot_local_ranks``, from
traind's ``gpus``/``CUDA_VISIBLE_DEVICES``, :meth:`traind.config.TrainerConfig.slot_local_ranks`);
every call into the slot's trainer runs under :func:`traind.distributed.on_device`, so
DeepSpeed builds the engine on it and CUDA's per-thread current device is it. On CPU
nothing is assigned.

Transport: the loop speaks dataclasses (:mod:`traind.work`) to orchestratord and stored through
:class:`traind.link.OrchestratorLink` and :class:`traind.link.StoreLink`; protos, deadlines and
rediscovery of a restarted peer stay in the link (:mod:`traind.link`, :mod:`traind.serde`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

from flexmarl import devicemodel
from flexmarl.artifacts import file_uri, publish_dir, weights_blob_name
from flexmarl.checkpoints import CheckpointManifest, manifest_blob_name, manifest_path, model_signature
from flexmarl.connections import cancelled_from_outside
from flexmarl.errors import FlexmarlError, InvalidArgument, NotFound
from flexmarl.jobspec import CheckpointSpec, JobSpec, JobSpecCache
from flexmarl.retry import Backoff
from traind import losses
from traind.distributed import become_standalone, join_group, on_device
from traind.link import OrchestratorCallError, OrchestratorLink, StoreLink
from traind.locations import MemoryStateStore, StateLocation, open_location
from traind.lora import LoraBaseCache, LoraSettings
from traind.metrics import TrainerMetrics
from traind.model import AgentTrainer, AgentTrainerConfig
from traind.pacing import ModelledDeviceClock
from traind.sft import WarmStart, run_warm_start
from traind.swap import swap_in, swap_out
from traind.weight_sync import AgentBroadcast, PushReport, WeightSyncError, distinct_tensors
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

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_WAIT_MS = 2000
#: How long rank 0 waits for the replicas at each step of a broadcast (rollout.weight_sync: distributed).
WEIGHT_SYNC_TIMEOUT_S = 30.0


def poll_backoff() -> Backoff:
    """Delays between failed polls of one slot (back to the first after a poll that got through)."""
    return Backoff(initial_s=0.2, max_s=5.0)


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """What the worker needs from traind's config."""

    worker_id: str
    slots: int
    work_dir: Path
    state_location: str  # mem | file | stored
    publish_location: str  # file | stored
    # host:port of this process's data-parallel rendezvous; "" = it never joins a group.
    dp_address: str = ""
    # Each slot's device as an index in this process's CUDA numbering (LOCAL_RANK); None: CPU.
    slot_local_ranks: tuple[int, ...] | None = None
    # Modelled device time (benchmarks; traind's modelled_device); None = real time only.
    device_profile: devicemodel.DeviceProfile | None = None
    # Each slot's training capacity (traind's slot_capacity), reported in its polls; None = 1 each.
    slot_capacities: tuple[float, ...] | None = None
    # Each slot's modelled device (device_profile at the slot's capacity); None = device_profile for every slot.
    slot_profiles: tuple[devicemodel.DeviceProfile, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ProcessGroupKey:
    """The data-parallel process group this process is in: ("", 0, 1, "") = a world of one."""

    group_id: str = ""
    rank: int = 0
    world_size: int = 1
    master_address: str = ""

    @classmethod
    def of(cls, group: DataParallelGroup | None) -> ProcessGroupKey:
        """The key a piece of work asks for (a group of one = standalone)."""
        if group is None or group.world_size <= 1:
            return cls()
        return cls(group.group_id, group.rank, group.world_size, group.master_address)


@dataclasses.dataclass
class Slot:
    """One training slot and the agent resident in it."""

    slot_id: str
    #: The slot's device (its LOCAL_RANK in this process); None: nothing assigned (CPU).
    local_rank: int | None = None
    #: Training capacity relative to one device (reported in polls; orchestratord places heavier agents on more).
    capacity: float = 1.0
    #: The slot's modelled device (benchmarks); None: the process's profile, if any.
    profile: devicemodel.DeviceProfile | None = None
    trainer: AgentTrainer | None = None
    job_id: str = ""
    agent: str = ""
    step_id: str = ""
    busy: bool = False
    busy_s: float = 0.0
    started_s: float = dataclasses.field(default_factory=time.monotonic)
    #: The frozen base the slot's LoRA agents share (kept across their swaps; traind.lora).
    lora_bases: LoraBaseCache = dataclasses.field(default_factory=LoraBaseCache)
    #: Device calls, experience reads and warm-start steps done (only grows): the progress its lease renewals
    #: report, so a slot stuck in one of them loses its lease (docs/reliability.md, Hung workers). It also
    #: counts the other slots' own work done while this one waited for the process's device lock.
    progress: int = 0
    #: This slot's own units of ``progress`` (what the other slots' waits are credited from).
    own_progress: int = 0
    #: Waiting for the process's device lock (another slot of this process computes).
    waiting_for_device: bool = False
    #: The process's own units when this slot's renewal last looked.
    seen_process_progress: int = 0

    def advance(self) -> None:
        """One unit of work done (called from the slot's device thread too: plain int stores)."""
        self.progress += 1
        self.own_progress += 1

    @property
    def resident(self) -> tuple[str, str] | None:
        """(job, agent) whose engine the slot holds."""
        return (self.job_id, self.agent) if self.trainer is not None else None


def trainer_config(spec: JobSpec, agent: str) -> AgentTrainerConfig:
    """The engine settings of one agent of a job."""
    a = spec.agent(agent)
    algo = spec.algorithm_of(agent)
    return AgentTrainerConfig(
        agent=agent, model_path=a.model, zero_stage=a.zero_stage, dtype=a.dtype, lr=a.optimizer.lr,
        betas=(a.optimizer.betas[0], a.optimizer.betas[1]), eps=a.optimizer.eps,
        weight_decay=a.optimizer.weight_decay, grad_clip=a.optimizer.grad_clip,
        loss=losses.PolicyLossConfig(clip_eps_low=algo.clip_eps, clip_eps_high=algo.clip_eps, kl_coef=algo.kl_coef,
                                     loss_agg=losses.LossAggregation(algo.loss_agg),
                                     entropy_coef=algo.entropy_coef,
                                     proximal=losses.ProximalPolicy(algo.proximal_policy),
                                     behaviour_weight_cap=algo.behaviour_weight_cap),
        advantage_norm=losses.AdvantageNorm(algo.advantage_norm),
        turn_baseline=losses.TurnBaseline(algo.turn_baseline),
        entropy_schedule=losses.EntropySchedule(algo.entropy_coef, algo.entropy_coef_end, algo.entropy_decay_steps),
        temperature=a.sampling.temperature,
        exact_accumulation=a.exact_accumulation,
        stale_token_bound=spec.pipeline.max_staleness if spec.rollout.mask_stale_tokens else None,
        lora=None if a.lora is None else LoraSettings(rank=a.lora.rank, alpha=a.lora.alpha, dropout=a.lora.dropout,
                                                      target_modules=tuple(a.lora.target_modules)),
    )


def _checkpoint_policy(spec: JobSpec | None) -> CheckpointSpec:
    """The job's retention policy (the default one before its spec was fetched)."""
    return spec.checkpoint if spec is not None else CheckpointSpec()


class TrainerWorker:
    """The slots of one traind process, over a link to orchestratord and one to stored."""

    def __init__(self, settings: TrainerSettings, metrics: TrainerMetrics, orchestrator: OrchestratorLink,
                 store: StoreLink) -> None:
        self.settings = settings
        self._metrics = metrics
        self._orchestrator = orchestrator
        self._store = store
        ranks = settings.slot_local_ranks
        if ranks is not None and len(ranks) != settings.slots:
            raise InvalidArgument(f"{len(ranks)} devices for {settings.slots} slots")
        capacities = settings.slot_capacities or (1.0,) * settings.slots
        profiles = settings.slot_profiles or (settings.device_profile,) * settings.slots
        if len(capacities) != settings.slots or len(profiles) != settings.slots:
            raise InvalidArgument(f"{len(capacities)} capacities and {len(profiles)} profiles for {settings.slots} "
                                  f"slots")
        self.slots = [Slot(f"{settings.worker_id}/slot{i}", None if ranks is None else ranks[i],
                           capacity=capacities[i], profile=profiles[i])
                      for i in range(settings.slots)]
        self._memory = MemoryStateStore()
        self._specs = JobSpecCache(orchestrator.job_spec)
        self._loops: list[asyncio.Task[None]] = []
        self._stopping = False
        # One engine at a time per process: DeepSpeed engines share the process group.
        self._compute = asyncio.Lock()
        # The data-parallel group the process is in now (the default: a world of one).
        self.group = ProcessGroupKey()
        #: (job, agent) -> its weight-update group, when this process is the agent's rank 0 (weight_sync distributed).
        self._broadcasts: dict[tuple[str, str], AgentBroadcast] = {}

    async def start(self) -> None:
        """Starts one poll loop per slot."""
        loop = asyncio.get_running_loop()
        self._loops = [loop.create_task(self._slot_loop(slot), name=slot.slot_id) for slot in self.slots]

    async def stop(self) -> None:
        """Stops polling; uncommitted work is abandoned (its leases expire and replay elsewhere).

        The links' connections belong to whoever made the links (:class:`traind.app.TrainerApp`).
        """
        self._stopping = True
        for task in self._loops:
            task.cancel()
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for slot in self.slots:
            if slot.trainer is not None:
                slot.trainer.release()
                slot.trainer = None
            slot.lora_bases.clear()
        for broadcast in self._broadcasts.values():
            broadcast.close()
        self._broadcasts.clear()

    @property
    def _group_local_rank(self) -> int:
        """The device a data-parallel group binds to: the one slot's (only one-slot processes join)."""
        rank = self.slots[0].local_rank if len(self.slots) == 1 else None
        return 0 if rank is None else rank

    async def _on_device(self, slot: Slot, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a pool thread, on the slot's device (:func:`traind.distributed.on_device`)."""
        result = await asyncio.to_thread(on_device, slot.local_rank, fn, *args)
        slot.advance()
        return result

    # ---- the loop ------------------------------------------------------------------------------

    async def _slot_loop(self, slot: Slot) -> None:
        backoff = poll_backoff()
        while not self._stopping:
            resident = [] if slot.trainer is None else [ResidentAgent(slot.job_id, slot.agent, slot.trainer.version)]
            try:
                work = await self._orchestrator.poll_work(slot.slot_id, resident, POLL_WAIT_MS,
                                                          self.settings.dp_address, capacity=slot.capacity)
            except (OrchestratorCallError, FlexmarlError) as exc:
                log.warning("polling work for %s failed (%s); retrying", slot.slot_id, exc)
                await backoff.sleep()
                continue
            backoff.reset()
            if work is not None:
                await self._run(slot, work)

    async def _run(self, slot: Slot, work: TrainerWork) -> None:
        """Runs one piece of work; a failed call to orchestratord is logged, any other failure fails the slot."""
        kind = type(work).__name__
        started = time.monotonic()
        slot.busy = True
        try:
            if isinstance(work, MicroBatchWork):
                async with self._renewing(slot, work):
                    await self._micro_batch(slot, work)
            elif isinstance(work, OptimizerStepWork):
                await self._optimizer_step(slot, work)
            elif isinstance(work, WarmStartWork):
                async with self._renewing(slot, work):
                    await self._warm_start(slot, work)
            else:
                await self._swap_out(slot, work)
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            log.warning("%s: a call was cancelled under %s (its channel closed)", slot.slot_id, kind)
        except OrchestratorCallError as exc:
            log.warning("%s: orchestrator call failed: %s", slot.slot_id, exc)
        except Exception as exc:
            log.exception("%s: %s failed", slot.slot_id, kind)
            await self._fail(slot, f"{type(exc).__name__}: {exc}", work)
        finally:
            slot.busy = False
            slot.busy_s += time.monotonic() - started
            self._metrics.observe_busy(slot)

    @contextlib.asynccontextmanager
    async def _renewing(self, slot: Slot, work: MicroBatchWork | WarmStartWork) -> AsyncIterator[None]:
        """Keeps a micro-batch's or a warm start's lease while the slot works on it, waiting for the device included.

        The lease lasts the job's ``leases.train_timeout_s``; a warm start, or the first
        micro-batch of an agent whose large state swaps in, may take far longer, so it is renewed
        every third of that, as rolloutd renews its tasks. A dead traind stops renewing and its
        lease expires; a lost lease (expired or re-issued) is logged once and the work goes on,
        since its ack or commit would be refused.
        """
        spec = await self._specs.get(work.job_id, work.spec_digest)
        interval_s = max(0.1, spec.leases.train_timeout_s / 3)
        renewer = asyncio.get_running_loop().create_task(self._renew_lease(slot, work.lease_id, interval_s),
                                                         name=f"renew {work.lease_id}")
        try:
            yield
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer

    @contextlib.asynccontextmanager
    async def _device_turn(self, slot: Slot) -> AsyncIterator[None]:
        """The process's device lock for ``slot``'s work; while it waits, the other slots' work is its progress.

        The slots of one process compute one at a time (one process group), so a slot's work can wait behind
        another slot's long one (a warm start runs under the lock for all its steps). That wait is not a
        hang: the slot's renewals count the work the process does meanwhile (:meth:`_credit_wait`), the way
        rolloutd counts a task waiting for its job's engines. A process whose lock holder is stuck does no
        work, so its waiting slots lose their leases as before.
        """
        slot.waiting_for_device = True
        try:
            async with self._compute:
                slot.waiting_for_device = False
                yield
        finally:
            slot.waiting_for_device = False

    def _credit_wait(self, slot: Slot) -> None:
        """Adds to a waiting slot's progress the units the process's slots did since its last renewal."""
        done = sum(other.own_progress for other in self.slots)
        if slot.waiting_for_device:
            slot.progress += max(0, done - slot.seen_process_progress)
        slot.seen_process_progress = done

    async def _renew_lease(self, slot: Slot, lease_id: str, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)  # a period, not a wait for a condition
            self._credit_wait(slot)
            try:
                lost = await self._orchestrator.renew_leases([lease_id], [slot.progress])
            except (OrchestratorCallError, FlexmarlError) as exc:
                log.warning("%s: renewing lease %s failed (%s); retrying", slot.slot_id, lease_id, exc)
                continue
            if lease_id in lost:
                log.warning("%s: lease %s is lost (expired or re-issued); its ack or commit will be refused",
                            slot.slot_id, lease_id)
                return

    async def _fail(self, slot: Slot, error: str, work: TrainerWork) -> None:
        """Drops the slot's (now untrustworthy) state and tells the orchestrator to replay.

        The report names the agent the slot held, else the one the work was for (it failed
        before the slot held anything, e.g. while building the engine).
        """
        job_id, agent = (slot.job_id, slot.agent) if slot.job_id else (work.job_id, work.agent)
        self._release(slot)
        slot.lora_bases.clear()  # a failure half-way through a LoRA build may have left an adapter in the base
        if self.group.world_size > 1:
            # The group may be broken (a member died): leave it; the next work re-forms one.
            with contextlib.suppress(Exception):
                async with self._compute:
                    await asyncio.to_thread(become_standalone, self._group_local_rank)
            self.group = ProcessGroupKey()
        if not job_id:
            return
        with contextlib.suppress(OrchestratorCallError, FlexmarlError):
            await self._orchestrator.report_slot_event(SlotEvent(slot.slot_id, job_id, agent, SlotEventKind.FAILED,
                                                                 error=error))

    def _release(self, slot: Slot) -> None:
        if slot.trainer is not None:
            slot.trainer.release()
        slot.trainer, slot.job_id, slot.agent, slot.step_id = None, "", "", ""

    # ---- work ----------------------------------------------------------------------------------

    def _location(self, uri: str, job_id: str) -> StateLocation:
        return open_location(uri, memory=self._memory, store=self._store.client_if_open(), job_id=job_id,
                             loop=asyncio.get_running_loop())

    async def _join(self, group: DataParallelGroup | None) -> None:
        """Puts the process into the work's process group (call under ``_compute``).

        A different group (or leaving one) means a new process group: every resident
        engine is released first (DeepSpeed engines are built on the default group).
        """
        wanted = ProcessGroupKey.of(group)
        if wanted == self.group:
            return
        for slot in self.slots:
            self._release(slot)
        self.group = ProcessGroupKey()
        if group is not None and wanted.world_size > 1:
            if len(self.slots) != 1:
                raise InvalidArgument(f"{self.settings.worker_id} has {len(self.slots)} slots: it cannot join "
                                      f"a data-parallel group")
            started = time.perf_counter()
            await asyncio.to_thread(join_group, wanted.rank, wanted.world_size, wanted.master_address,
                                    float(group.timeout_s or 60), self._group_local_rank)
            log.info("joined data-parallel group %s as rank %d of %d (%.2fs)", wanted.group_id, wanted.rank,
                     wanted.world_size, time.perf_counter() - started)
        else:
            await asyncio.to_thread(become_standalone, self._group_local_rank)
            log.info("left the data-parallel group: a world of one again")
        self.group = wanted

    async def _bind(self, slot: Slot, work: MicroBatchWork | OptimizerStepWork) -> AgentTrainer:
        """Makes (job, agent) at base_version resident in the slot (swapping as needed)."""
        await self._join(work.group)
        spec = await self._specs.get(work.job_id, work.spec_digest)
        key = (work.job_id, work.agent)
        if slot.trainer is not None and (slot.resident != key or slot.trainer.version != work.base_version):
            log.info("%s: releasing %s/%s v%d", slot.slot_id, slot.job_id, slot.agent, slot.trainer.version)
            self._release(slot)
        if slot.trainer is None:
            config = trainer_config(spec, work.agent)
            started = time.perf_counter()
            clock = self._device_clock(slot, work.agent)
            if work.state_uri:
                if work.state_uri.startswith("stored://"):
                    await self._store.client()
                location = self._location(work.state_uri, work.job_id)
                trainer, stats = await self._on_device(slot, lambda: swap_in(config, location, clock,
                                                                             lora_bases=slot.lora_bases))
                self._metrics.observe_swap("in", stats.bytes_moved, stats.seconds)
            elif work.base_version == 0:
                if spec.agent(work.agent).warm_start is not None:
                    raise InvalidArgument(f"{work.agent} v0 is its published warm start: the work names no "
                                          f"state_uri to load it from")
                trainer = await self._on_device(slot, lambda: AgentTrainer(config, clock, lora_bases=slot.lora_bases))
            else:
                raise InvalidArgument(f"{work.agent} v{work.base_version}: no state_uri to load from")
            if trainer.version != work.base_version:
                trainer.release()
                raise InvalidArgument(f"state of {work.agent} is v{trainer.version}, work needs v{work.base_version}")
            log.info("%s: %s/%s v%d resident (%.2fs)", slot.slot_id, work.job_id, work.agent, trainer.version,
                     time.perf_counter() - started)
            slot.trainer, slot.job_id, slot.agent, slot.step_id = trainer, work.job_id, work.agent, ""
        return slot.trainer

    @staticmethod
    def _device_clock(slot: Slot, agent: str) -> ModelledDeviceClock | None:
        """A modelled-device clock (the slot's device) for a trainer of ``agent`` built now (None: real time only)."""
        profile = slot.profile
        return ModelledDeviceClock(profile, f"traind-{os.getpid()}-{agent}") if profile is not None else None

    @staticmethod
    async def _settle(trainer: AgentTrainer) -> None:
        """Waits out the trainer's modelled device time, outside ``_compute``: the slots are separate devices."""
        if trainer.device_clock is not None:
            await asyncio.to_thread(trainer.device_clock.settle)

    async def _micro_batch(self, slot: Slot, work: MicroBatchWork) -> None:
        async with self._device_turn(slot):
            trainer = await self._bind(slot, work)
            if slot.step_id != work.step_id:
                trainer.discard_gradients()  # a new step, or a replay of one: start from zero
                slot.step_id = work.step_id
            records = await self._store.read_experiences(work.job_id, work.experience_ids)
            slot.advance()
            step_stats = (losses.ReturnStats(work.step_return_count, work.step_return_mean, work.step_return_std)
                          if work.step_return_count else None)
            stats = await self._on_device(
                slot, lambda: trainer.accumulate(records, micro_batch_index=work.micro_batch_index,
                                                 step_stats=step_stats))
        await self._settle(trainer)
        self._metrics.observe_micro_batch(work.agent, stats.response_tokens, stats.seconds)
        # Episodes, not experiences: an agent with several turns per episode has several experiences each.
        episodes = len({(r.task_id, r.sample_index) for r in records})
        await self._orchestrator.ack_micro_batch(slot.slot_id, work.lease_id, episodes)

    async def _warm_start(self, slot: Slot, work: WarmStartWork) -> None:
        """The agent's warm start (traind/sft.py) on a fresh engine, published and committed as version 0.

        The slot keeps the engine at version 0 (step count 0, fresh optimizer moments), so the
        agent's first RL micro-batch finds it resident; any other engine finds the saved state.
        """
        spec = await self._specs.get(work.job_id, work.spec_digest)
        warm = WarmStart.of(spec, work.agent)
        if warm is None:
            raise InvalidArgument(f"{work.agent} of {work.job_id} has no warm_start")
        started = time.perf_counter()
        async with self._device_turn(slot):
            await self._join(None)
            if slot.trainer is not None:  # another agent, or this one from an earlier attempt: start from the base
                log.info("%s: releasing %s/%s v%d", slot.slot_id, slot.job_id, slot.agent, slot.trainer.version)
                self._release(slot)
            config = trainer_config(spec, work.agent)
            clock = self._device_clock(slot, work.agent)
            trainer = await self._on_device(slot, lambda: AgentTrainer(config, clock, lora_bases=slot.lora_bases))
            try:
                report = await self._on_device(slot, functools.partial(run_warm_start, on_step=slot.advance),
                                               trainer, warm)
                weights_uri = await self._publish(slot, trainer, work.job_id, work.agent, 0)
                state_uri = await self._save_state(slot, trainer, work.job_id, work.agent, 0)
            except BaseException:
                trainer.release()
                raise
            slot.trainer, slot.job_id, slot.agent, slot.step_id = trainer, work.job_id, work.agent, ""
        await self._settle(trainer)
        seconds = time.perf_counter() - started
        await self._orchestrator.commit_step(StepCommit(
            slot_id=slot.slot_id, job_id=work.job_id, agent=work.agent, step=0, new_version=0,
            weights_uri=weights_uri, state_uri=state_uri, loss=report.last_loss, grad_norm=0.0,
            step_seconds=seconds))
        log.info("%s: %s/%s warm start committed as v0 (%d steps, loss %.4f -> %.4f, %.2fs)", slot.slot_id,
                 work.job_id, work.agent, len(report.steps), report.first_loss, report.last_loss, seconds)
        await self._write_manifest(trainer, work.job_id, work.agent, 0, work.spec_digest, weights_uri, state_uri,
                                   spec)

    async def _optimizer_step(self, slot: Slot, work: OptimizerStepWork) -> None:
        group = work.group if work.group is not None and work.group.world_size > 1 else None
        if group is not None and (ProcessGroupKey.of(group) != self.group or slot.step_id != work.step_id
                                  or slot.trainer is None):
            # A member that was given no micro-batch of this step: it joins with a zero gradient.
            async with self._device_turn(slot):
                trainer = await self._bind(slot, work)
                trainer.discard_gradients()
                slot.step_id = work.step_id
        if slot.resident != (work.job_id, work.agent) or slot.step_id != work.step_id or slot.trainer is None:
            raise InvalidArgument(f"optimizer step {work.step_id} is not the step accumulated in {slot.slot_id}")
        trainer = slot.trainer
        started = time.perf_counter()
        if group is not None and group.rank > 0:
            await self._member_optimizer_step(slot, trainer, work, group)
            return
        async with self._device_turn(slot):
            stats = await self._on_device(slot, lambda: trainer.optimizer_step(
                work.step_response_tokens, work.step_sequences, num_micro_batches=work.num_micro_batches))
            if trainer.version != work.new_version:
                raise InvalidArgument(f"optimizer step produced v{trainer.version}, expected v{work.new_version}")
            push = await self._start_broadcast(slot, trainer, work)
            try:  # the durable copy is written while the version is broadcast; the commit waits for both
                weights_uri = await self._publish(slot, trainer, work.job_id, work.agent, work.new_version)
                state_uri = await self._save_state(slot, trainer, work.job_id, work.agent, work.new_version)
            finally:
                if push is not None:
                    await self._finish_broadcast(push, work)
        await self._settle(trainer)
        seconds = time.perf_counter() - started
        self._metrics.observe_step(work.agent, stats, seconds)
        await self._orchestrator.commit_step(StepCommit(
            slot_id=slot.slot_id, job_id=work.job_id, agent=work.agent, step=work.step, new_version=work.new_version,
            weights_uri=weights_uri, state_uri=state_uri, loss=stats.loss, grad_norm=stats.grad_norm,
            step_seconds=seconds,
            figures={"kl": stats.kl, "clip_fraction": stats.clip_fraction, "ratio_mean": stats.ratio_mean,
                     # rollout.mask_stale_tokens: the share of the step's response tokens masked as too stale
                     "stale_token_fraction": stats.stale_tokens / max(1, stats.response_tokens + stats.stale_tokens)}))
        slot.step_id = ""
        log.info("%s: %s/%s step %d committed (v%d, loss %.4f, grad norm %.3f, %.2fs)", slot.slot_id,
                 work.job_id, work.agent, work.step, work.new_version, stats.loss, stats.grad_norm, seconds)
        spec = self._specs.cached_spec(work.job_id)
        await self._write_manifest(trainer, work.job_id, work.agent, work.new_version, work.spec_digest, weights_uri,
                                   state_uri, spec)
        self._prune(work.job_id, work.agent, work.new_version, spec)
        await self._prune_stored(work.job_id, work.agent, work.new_version, spec)

    def _broadcast_of(self, trainer: AgentTrainer, work: OptimizerStepWork) -> AgentBroadcast | None:
        """The agent's weight-update group when its job syncs weights over one (None: disk only).

        Not for LoRA agents (they publish adapters) nor ZeRO 3 groups (gathering is collective).
        """
        spec = self._specs.cached_spec(work.job_id)
        if spec is None or spec.rollout.weight_sync != "distributed" or spec.agent(work.agent).lora is not None:
            return None
        if trainer.config.zero_stage == 3 and self.group.world_size > 1:
            return None
        key = (work.job_id, work.agent)
        broadcast = self._broadcasts.get(key)
        if broadcast is None:
            host = self.settings.dp_address.rpartition(":")[0].strip("[]") or "127.0.0.1"
            cuda = next(trainer.engine.module.parameters()).is_cuda
            broadcast = AgentBroadcast(work.job_id, work.agent, host=host, backend="nccl" if cuda else "gloo",
                                       timeout_s=WEIGHT_SYNC_TIMEOUT_S)
            self._broadcasts[key] = broadcast
        return broadcast

    async def _start_broadcast(self, slot: Slot, trainer: AgentTrainer,
                               work: OptimizerStepWork) -> asyncio.Future[PushReport | None] | None:
        """Announces the new version with its group and starts broadcasting it (:mod:`traind.weight_sync`).

        The tensors are the module's own (no copy: nothing changes them before the commit, which
        waits for the broadcast), gathered first under ZeRO 3. None when the job syncs from disk
        only, or the announcement failed (the replicas then load the committed checkpoint).
        """
        broadcast = self._broadcast_of(trainer, work)
        if broadcast is None:
            return None
        try:
            if trainer.config.zero_stage == 3:
                state = await self._on_device(slot, trainer.full_state_dict)
            else:
                state = {name: t.detach() for name, t in trainer.engine.module.state_dict().items()}
            params = distinct_tensors(state)
            record = await asyncio.to_thread(broadcast.announce, params)
            peers = await self._orchestrator.announce_weights(slot.slot_id, work.job_id, work.agent,
                                                              work.new_version, record)
            record = dataclasses.replace(record, peers=peers)
        except (OrchestratorCallError, FlexmarlError, RuntimeError, ValueError) as exc:
            log.warning("%s: not broadcasting %s/%s v%d (%s); the replicas load it from disk", slot.slot_id,
                        work.job_id, work.agent, work.new_version, exc)
            return None
        return asyncio.ensure_future(self._on_device(slot, broadcast.push, params, work.new_version, record))

    async def _finish_broadcast(self, push: asyncio.Future[PushReport | None], work: OptimizerStepWork) -> None:
        """Waits for the broadcast (bounded by the group's timeout); a failed one only costs the replicas a reload."""
        try:
            await push  # AgentBroadcast.push logs what it moved
        except WeightSyncError as exc:
            log.warning("%s/%s v%d: broadcast failed (%s); replicas that missed it load the checkpoint",
                        work.job_id, work.agent, work.new_version, exc)

    async def _member_optimizer_step(self, slot: Slot, trainer: AgentTrainer, work: OptimizerStepWork,
                                     group: DataParallelGroup) -> None:
        """Rank > 0 of a group: the same collectives as rank 0 (step, publish, save), nothing kept, no commit."""
        started = time.perf_counter()
        scratch = self.settings.work_dir / "dp-scratch" / f"{work.agent}-v{work.new_version}"
        try:
            async with self._device_turn(slot):
                stats = await self._on_device(slot, lambda: trainer.optimizer_step(
                    work.step_response_tokens, work.step_sequences, num_micro_batches=work.num_micro_batches))
                if trainer.version != work.new_version:
                    raise InvalidArgument(f"optimizer step produced v{trainer.version}, expected v{work.new_version}")
                # publish() gathers and barriers on every rank (rank 0 writes); save_state's
                # checkpoint barriers too: rank 0 writes the whole ZeRO 0 state, this rank nothing it needs.
                await self._on_device(slot, trainer.publish, scratch / "weights")
                await self._on_device(slot, trainer.save_state,
                                      self._location(file_uri(scratch / "state"), work.job_id))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        await self._settle(trainer)
        seconds = time.perf_counter() - started
        self._metrics.observe_step(work.agent, stats, seconds)
        slot.step_id = ""
        log.info("%s: %s/%s step %d done as rank %d of %d (rank 0 commits; %.2fs)", slot.slot_id, work.job_id,
                 work.agent, work.step, group.rank, group.world_size, seconds)

    async def _publish(self, slot: Slot, trainer: AgentTrainer, job_id: str, agent: str, version: int) -> str:
        out = self.settings.work_dir / "weights" / job_id / agent / f"v{version}"
        await self._on_device(slot, trainer.publish, out)
        if self.settings.publish_location == "stored":
            return await publish_dir(out, weights_blob_name(job_id, agent, version), await self._store.client(),
                                     job_id)
        return file_uri(out)

    async def _save_state(self, slot: Slot, trainer: AgentTrainer, job_id: str, agent: str, version: int) -> str:
        kind = self.settings.state_location
        uri = self._state_uri(kind, job_id, agent, version)
        if kind == "stored":
            await self._store.client()
        location = self._location(uri, job_id)
        started = time.perf_counter()
        moved = await self._on_device(slot, trainer.save_state, location)
        self._metrics.observe_swap("save", moved, time.perf_counter() - started)
        return uri

    def _state_uri(self, kind: str, job_id: str, agent: str, version: int) -> str:
        if kind == "mem":
            return f"mem://{self.settings.worker_id}/{job_id}/{agent}/v{version}"
        if kind == "stored":
            return f"stored://states/{job_id}/{agent}/v{version}"
        return file_uri(self.settings.work_dir / "states" / job_id / agent / f"v{version}")

    async def _write_manifest(self, trainer: AgentTrainer, job_id: str, agent: str, version: int, digest: str,
                              weights_uri: str, state_uri: str, spec: JobSpec | None) -> None:
        """Writes the committed version's manifest beside its durable state (:mod:`flexmarl.checkpoints`).

        After the commit, so a manifest only ever names a committed version; best effort (a version
        without one is just not offered to a resume). States in ``mem://`` get none: no other
        cluster can read them.
        """
        kind = self.settings.state_location
        if spec is None or kind not in ("file", "stored"):
            return
        manifest = CheckpointManifest(
            job_id=job_id, agent=agent, version=version, weights_uri=weights_uri,
            state_uri=state_uri, spec_digest=digest, spec_json=spec.to_json(),
            model_signature=model_signature(trainer.engine.module.config.to_dict()),
            committed_unix_ms=int(time.time() * 1000))
        data = manifest.to_json().encode()
        try:
            if kind == "stored":
                store = await self._store.client()
                await store.put_blob_bytes(manifest_blob_name(job_id, agent, version), data,
                                           job_id=job_id)
            else:
                path = manifest_path(self.settings.work_dir, job_id, agent, version)
                path.parent.mkdir(parents=True, exist_ok=True)
                staging = path.with_name(path.name + ".tmp")
                staging.write_bytes(data)
                os.replace(staging, path)
        except Exception as exc:  # after the commit: a failure here must not fail the slot
            log.warning("no checkpoint manifest for %s/%s v%d: %s", job_id, agent, version, exc)

    def _prune(self, job_id: str, agent: str, version: int, spec: JobSpec | None) -> None:
        """Deletes the local weights and states the job's checkpoint policy no longer retains.

        ``version`` was just committed; of :meth:`CheckpointSpec.prune_candidates`, what the policy
        no longer keeps is deleted.
        """
        policy = _checkpoint_policy(spec)
        for old in policy.prune_candidates(version):
            if not policy.keeps_weights(old, version):
                shutil.rmtree(self.settings.work_dir / "weights" / job_id / agent / f"v{old}", ignore_errors=True)
            if not (policy.keeps_state(old, version) and policy.keeps_weights(old, version)):
                # Not resumable any more: its manifest goes first.
                manifest_path(self.settings.work_dir, job_id, agent, old).unlink(missing_ok=True)
            if not policy.keeps_state(old, version):
                shutil.rmtree(self.settings.work_dir / "states" / job_id / agent / f"v{old}", ignore_errors=True)
                with contextlib.suppress(FlexmarlError, KeyError):
                    self._memory.pop(f"{self.settings.worker_id}/{job_id}/{agent}/v{old}")

    async def _prune_stored(self, job_id: str, agent: str, version: int, spec: JobSpec | None) -> None:
        """:meth:`_prune` for what was published or saved to stored (best effort: logged, never raised)."""
        if "stored" not in (self.settings.publish_location, self.settings.state_location):
            return
        policy = _checkpoint_policy(spec)
        try:
            store = await self._store.client()
            for old in policy.prune_candidates(version):
                if self.settings.publish_location == "stored" and not policy.keeps_weights(old, version):
                    with contextlib.suppress(NotFound):
                        await store.delete_blob(weights_blob_name(job_id, agent, old))
                if self.settings.state_location == "stored" and not (policy.keeps_state(old, version)
                                                                      and policy.keeps_weights(old, version)):
                    with contextlib.suppress(NotFound):
                        await store.delete_blob(manifest_blob_name(job_id, agent, old))
                if self.settings.state_location == "stored" and not policy.keeps_state(old, version):
                    for blob in await store.list_blobs(f"states/{job_id}/{agent}/v{old}/"):
                        with contextlib.suppress(NotFound):
                            await store.delete_blob(blob.name)
        except FlexmarlError as exc:
            log.warning("pruning %s/%s in stored after v%d failed: %s", job_id, agent, version, exc)

    async def _swap_out(self, slot: Slot, work: SwapOutWork) -> None:
        if slot.resident != (work.job_id, work.agent) or slot.trainer is None:
            raise InvalidArgument(f"{slot.slot_id} does not hold {work.job_id}/{work.agent}")
        if self.group.world_size > 1:
            # Saving is collective in a group; orchestratord never asks (DP states are durable).
            raise InvalidArgument(f"{slot.slot_id}: cannot swap out an engine of a data-parallel group")
        kind = work.location if work.location in ("mem", "file", "stored") else self.settings.state_location
        uri = self._state_uri(kind, work.job_id, work.agent, slot.trainer.version)
        if kind == "stored":
            await self._store.client()
        async with self._device_turn(slot):
            stats = await self._on_device(slot, swap_out, slot.trainer, self._location(uri, work.job_id))
        self._metrics.observe_swap("out", stats.bytes_moved, stats.seconds)
        slot.trainer, slot.job_id, slot.agent, slot.step_id = None, "", "", ""
        await self._orchestrator.report_slot_event(SlotEvent(slot.slot_id, work.job_id, work.agent,
                                                             SlotEventKind.SWAPPED_OUT, state_uri=uri))

    @property
    def device(self) -> str:
        """"cuda" when this host trains on GPUs, else "cpu"."""
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def memory_bytes_per_slot(self) -> int:
        """Capacity of one slot: a GPU's memory, or an equal share of host memory on CPU."""
        import psutil
        import torch

        if torch.cuda.is_available():
            first = self.slots[0].local_rank if self.slots else None
            return int(torch.cuda.get_device_properties(first or 0).total_memory)
        return int(psutil.virtual_memory().total // max(1, len(self.slots)))

    def status(self) -> list[SlotStatus]:
        """Per-slot status for GetTrainerStatus."""
        now = time.monotonic()
        device, memory_bytes = self.device, self.memory_bytes_per_slot
        return [
            SlotStatus(slot_id=s.slot_id, device=device, memory_bytes=memory_bytes,
                       resident=ResidentAgent(s.job_id, s.agent, s.trainer.version) if s.trainer is not None else None,
                       busy=s.busy, busy_fraction=s.busy_s / max(1e-9, now - s.started_s),
                       dp_group_id=self.group.group_id, dp_rank=self.group.rank, dp_world_size=self.group.world_size,
                       capacity=s.capacity)
            for s in self.slots
        ]
