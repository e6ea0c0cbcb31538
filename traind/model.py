"""AgentTrainer: one DeepSpeed engine for one agent, with step-exact gradient accumulation.

How the step gradient stays independent of micro-batching (DESIGN §3):

* DeepSpeed runs with ``gradient_accumulation_steps=1`` and
  ``managed_gradient_accumulation=false``: nothing divides by a micro-step count.
* Every micro-batch loss is a plain sum (:mod:`traind.losses`); advantages come from
  complete groups inside the micro-batch.
* Exact accumulation (``exact_accumulation``, the default for fp32 ZeRO 0/1): each GRPO group
  of a micro-batch runs its own forward and ``torch.autograd.grad`` (records in a canonical
  order, packed alone, so its gradient depends only on the group and the parameters), and the
  group gradients are summed exactly (:class:`traind.accumulation.ExactGradientSum`, integer
  limbs). The step gradient is then a function of the *set* of groups of the step: the same
  bytes whatever the arrival order, the cut into micro-batches, the data-parallel member each
  micro-batch went to (the limbs are all-reduced; DeepSpeed's own averaging is off under
  ZeRO 0) or a replay. The per-group statistics are summed with ``math.fsum`` (exact, then
  rounded once). Without it (bf16, ZeRO 2/3, or switched off):
  ``engine.backward(loss, scale_wrt_gas=False)`` per micro-batch adds into DeepSpeed's
  gradient buffers in arrival order (ZeRO 0/1 reduce in ``step()``, ZeRO 2/3 per backward).
* At ``optimizer_step`` the fixed normaliser ``N`` of the step (response tokens or
  sequences over all data-parallel ranks) is known. DeepSpeed's own clipping is off
  (``gradient_clipping=0``); a step pre-hook on the basic optimizer multiplies the
  reduced gradients by ``1 / N`` (exact: every rank holds the sum) or ``W / N`` (DeepSpeed
  averaged over the ``W`` ranks), takes the global norm (all-reduced over the ranks when ZeRO
  partitions the optimizer) and clips to the job's ``grad_clip`` before the update.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.comm as dist
import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from flexmarl.errors import FailedPrecondition, InvalidArgument
from flexmarl.experience import ExperienceRecord
from traind import lora, losses
from traind.accumulation import ExactGradientSum
from traind.batches import micro_batch_advantages, pack_micro_batch, token_logprobs, token_logprobs_and_entropy
from traind.distributed import ensure_distributed
from traind.locations import StateLocation
from traind.lora import LoraBaseCache, LoraSettings
from traind.pacing import ModelledDeviceClock

logger = logging.getLogger(__name__)

CHECKPOINT_TAG = "state"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
WEIGHT_INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "config.json")


class OptimizerImpl(enum.StrEnum):
    """Which AdamW implementation the engine steps with."""

    TORCH = "torch"  # torch.optim.AdamW passed to deepspeed.initialize: no JIT build
    DEEPSPEED = "deepspeed"  # DeepSpeed's own (cpu_adam / fused_adam): JIT-compiled on first use


@dataclasses.dataclass(frozen=True)
class AgentTrainerConfig:
    """Everything needed to (re)build one agent's engine.

    Attributes:
        agent: agent name (for logs and metrics).
        model_path: Hugging Face causal-LM checkpoint dir the agent starts from.
        zero_stage: DeepSpeed ZeRO stage 0..3.
        dtype: ``fp32`` or ``bf16``.
        lr: AdamW learning rate.
        betas: AdamW betas.
        eps: AdamW epsilon.
        weight_decay: AdamW decoupled weight decay.
        grad_clip: max global L2 norm of the normalised step gradient; ``0`` disables.
        optimizer_impl: ``torch`` (default) or ``deepspeed``.
        loss: clip/KL/aggregation settings.
        advantage_norm: ``std`` / ``mean`` (GRPO in the group), ``agent`` (over the step: the
            statistics come with each micro-batch) or ``none`` (:class:`traind.losses.AdvantageNorm`).
        advantage_eps: added to the group std.
        turn_baseline: the group statistics of ``std`` / ``mean`` (:class:`traind.losses.TurnBaseline`).
        entropy_schedule: the entropy-bonus coefficient per trained version; None: ``loss.entropy_coef``.
        temperature: the agent's sampling temperature; logprobs are computed from logits / T
            to match the behaviour logprobs the engine reported (T <= 0, greedy, uses raw logits).
        exact_accumulation: sum the step's group gradients exactly, independent of their order,
            cut and data-parallel split (fp32 with ZeRO 0/1 only; ignored otherwise). Costs 16 bytes
            per parameter and one forward/backward per group (docs/pipeline.md).
        stale_token_bound: ``rollout.mask_stale_tokens``: tokens sampled more than this many
            versions before the version being trained get zero weight; None masks nothing.
        lora: train only a LoRA adapter over ``model_path`` (its frozen base; :mod:`traind.lora`);
            None trains the whole model.
    """

    agent: str
    model_path: str
    zero_stage: int = 0
    dtype: str = "fp32"
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    optimizer_impl: OptimizerImpl = OptimizerImpl.TORCH
    loss: losses.PolicyLossConfig = dataclasses.field(default_factory=losses.PolicyLossConfig)
    advantage_norm: losses.AdvantageNorm = losses.AdvantageNorm.STD
    advantage_eps: float = 1e-6
    turn_baseline: losses.TurnBaseline = losses.TurnBaseline.EPISODE
    entropy_schedule: losses.EntropySchedule | None = None
    temperature: float = 1.0
    exact_accumulation: bool = True
    stale_token_bound: int | None = None
    lora: LoraSettings | None = None

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise InvalidArgument(f"zero_stage must be 0..3, got {self.zero_stage}")
        if self.dtype not in ("fp32", "bf16"):
            raise InvalidArgument(f"dtype must be fp32 or bf16, got {self.dtype!r}")
        if self.grad_clip < 0.0 or self.lr < 0.0:
            raise InvalidArgument("grad_clip and lr must be >= 0")
        if self.lora is not None and self.zero_stage != 0:
            raise InvalidArgument(f"a LoRA agent trains with ZeRO 0, got zero_stage {self.zero_stage}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The parameter dtype of the engine's module."""
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32

    @property
    def exact(self) -> bool:
        """Whether the step gradient is summed exactly (see ``exact_accumulation``)."""
        return self.exact_accumulation and self.dtype == "fp32" and self.zero_stage <= 2


@dataclasses.dataclass(frozen=True)
class MicroBatchStats:
    """What one ``accumulate`` call did (loss is the un-normalised sum)."""

    sequences: int
    response_tokens: int
    loss_sum: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class StepStats:
    """One optimizer step, aggregated over micro-batches and data-parallel ranks.

    Attributes:
        version: committed optimizer steps after this one.
        loss: the step loss (normalised sum, as the gradient).
        grad_norm: global L2 norm of the normalised gradient before clipping.
        clip_fraction: fraction of response tokens whose ratio term was clipped.
        kl: mean per-token k3 KL to the reference (0 when kl_coef is 0).
        ratio_mean: mean importance ratio over response tokens.
        response_tokens: step response tokens (the token-mean normaliser).
        sequences: step sequences (the seq-mean normaliser).
        micro_batches: micro-batches accumulated on this rank.
        seconds: time of the optimizer step itself.
    """

    version: int
    loss: float
    grad_norm: float
    clip_fraction: float
    kl: float
    ratio_mean: float
    response_tokens: int
    sequences: int
    micro_batches: int
    seconds: float
    stale_tokens: int = 0  # response tokens left out as older than ``stale_token_bound`` (not in response_tokens)


@dataclasses.dataclass(frozen=True)
class _UnitStats:
    """Statistics of one accumulation unit (a group, or a whole micro-batch without exact accumulation)."""

    loss_sum: float
    tokens: int
    sequences: int
    clipped_tokens: float
    kl_sum: float
    ratio_sum: float
    stale_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class _MicroBatchSeen:
    experience_ids: tuple[str, ...]
    stats: MicroBatchStats


@dataclasses.dataclass
class _StepAccumulator:
    """What the current step accumulated on this rank (the gradient itself lives in the engine or the limbs)."""

    # Keyed by the sorted group ids of the unit: the totals are summed in key order.
    units: dict[tuple[str, ...], _UnitStats] = dataclasses.field(default_factory=dict)
    groups: set[str] = dataclasses.field(default_factory=set)
    # micro_batch_index -> what it held (when the caller passes indices).
    indexed: dict[int, _MicroBatchSeen] = dataclasses.field(default_factory=dict)
    micro_batches: int = 0
    # An accumulate failed half-way: part of a micro-batch is in the gradient.
    broken: bool = False


def _groups_of(micro_batch: Sequence[ExperienceRecord]) -> dict[str, list[ExperienceRecord]]:
    """The micro-batch's records by group, each group in a canonical order (sample, turn, id)."""
    groups: dict[str, list[ExperienceRecord]] = {}
    for rec in micro_batch:
        groups.setdefault(rec.group_id, []).append(rec)
    for records in groups.values():
        records.sort(key=lambda r: (r.sample_index, r.turn, r.experience_id))
    return groups


def _capture_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def directory_bytes(path: Path) -> int:
    """Total size of the regular files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class AgentTrainer:
    """One agent's DeepSpeed engine in one trainer slot (one process = one DP rank).

    Not thread-safe: call it from one thread at a time.
    """

    def __init__(self, config: AgentTrainerConfig, device_clock: ModelledDeviceClock | None = None, *,
                 lora_bases: LoraBaseCache | None = None) -> None:
        """Loads the agent's checkpoint and builds its engine (initialises the process group if needed).

        Args:
            config: the agent's engine settings.
            device_clock: modelled device time (benchmarks): every micro-batch and optimizer step
                is charged to it and its owner settles it (real math still runs); None = real time only.
            lora_bases: the slot's base cache: a LoRA agent borrows its base from it (and gives it back
                on :meth:`release`); a full-model agent empties it (the memory is its own now). None:
                a LoRA agent loads a base of its own.
        """
        ensure_distributed()
        self.config = config
        self.device_clock = device_clock
        self._lora_bases = lora_bases
        self._engine: Any = None
        self._reference: PreTrainedModel | None = None
        self._acc = _StepAccumulator()
        self._exact_sum: ExactGradientSum | None = None
        self._pending_grad_scale: float | None = None
        self._last_grad_norm = 0.0
        self._build_engine()

    # ------------------------------------------------------------------ build

    def _ds_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            # Clipping needs the step normaliser, so it happens in our pre-step hook.
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": self.config.zero_stage},
            "bf16": {"enabled": self.config.dtype == "bf16"},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        if self.config.optimizer_impl is OptimizerImpl.DEEPSPEED:
            cfg["optimizer"] = {
                "type": "AdamW",
                "params": {
                    "lr": self.config.lr,
                    "betas": list(self.config.betas),
                    "eps": self.config.eps,
                    "weight_decay": self.config.weight_decay,
                },
            }
        return cfg

    def _load_model(self) -> Any:
        """The module to train: the checkpoint, or the slot's frozen base with the agent's adapter in it."""
        cfg = self.config
        bases = self._lora_bases
        if cfg.lora is None:
            if bases is not None:
                bases.clear()
            model: Any = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=cfg.torch_dtype)
            model.config.use_cache = False
            return model
        base = (bases.acquire(cfg.model_path, cfg.torch_dtype) if bases is not None
                else LoraBaseCache().acquire(cfg.model_path, cfg.torch_dtype))
        try:
            return lora.attach_adapter(base, cfg.lora, cfg.agent)
        except BaseException:
            if bases is not None:
                bases.give_back(base)
            raise

    def _build_engine(self) -> None:
        cfg = self.config
        model = self._load_model()
        # Only what trains: all of a full model, the adapter of a LoRA agent (its optimizer state too).
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer: torch.optim.Optimizer | None = None
        if cfg.optimizer_impl is OptimizerImpl.TORCH:
            # One param group: ZeRO steps group by group and the clip norm must span all of them.
            optimizer = torch.optim.AdamW(
                trainable, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
            )
        try:
            engine, *_ = deepspeed.initialize(
                model=model,
                optimizer=optimizer,
                model_parameters=None if optimizer is not None else trainable,
                config=self._ds_config(),
            )
        except BaseException:
            self._return_base(model)
            raise
        self._engine = engine
        engine.basic_optimizer.register_step_pre_hook(self._normalise_and_clip_hook)
        if cfg.exact:
            self._exact_sum = ExactGradientSum([p for p in engine.module.parameters() if p.requires_grad])
            if cfg.zero_stage == 0:
                # Every rank holds the exact step sum after the limbs' all-reduce: DeepSpeed's
                # averaging would only round it again (W not a power of two).
                engine.enable_backward_allreduce = False
        engine.train()
        logger.info(
            "agent %s: engine built (zero=%d dtype=%s optimizer=%s world=%d exact accumulation=%s)",
            cfg.agent,
            cfg.zero_stage,
            cfg.dtype,
            type(engine.optimizer).__name__,
            engine.dp_world_size,
            cfg.exact,
        )

    @property
    def engine(self) -> Any:
        """The live DeepSpeed engine (raises when the agent is swapped out)."""
        if self._engine is None:
            raise FailedPrecondition(f"agent {self.config.agent} has no engine (swapped out)")
        return self._engine

    @property
    def version(self) -> int:
        """Committed optimizer steps."""
        return int(self.engine.global_steps)

    @property
    def rank(self) -> int:
        """Data-parallel rank of this process in the agent's group."""
        return int(dist.get_rank()) if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        """Data-parallel world size of the agent."""
        return int(self.engine.dp_world_size)

    @property
    def device(self) -> torch.device:
        """Device of the engine's module."""
        return torch.device(self.engine.device)

    def _reference_logprobs(self, input_ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """Token logprobs of the KL reference: the initial policy, or a LoRA agent's base (adapter disabled)."""
        if self.config.lora is not None:
            with lora.adapter_disabled(self.engine.module):
                return token_logprobs(self.engine.module, input_ids, attention, self.config.temperature)
        return token_logprobs(self._reference_model(), input_ids, attention, self.config.temperature)

    def _reference_model(self) -> PreTrainedModel:
        """The frozen initial policy for the KL term, rebuilt from the checkpoint dir on demand."""
        if self._reference is None:
            ref: Any = AutoModelForCausalLM.from_pretrained(self.config.model_path, dtype=self.config.torch_dtype)
            ref.requires_grad_(False)
            self._reference = ref.to(self.device).eval()
        return self._reference

    # --------------------------------------------------------------- training

    def accumulate(self, micro_batch: Sequence[ExperienceRecord], *,
                   micro_batch_index: int | None = None,
                   step_stats: losses.ReturnStats | None = None) -> MicroBatchStats:
        """Forward + backward of one micro-batch of complete groups; adds its loss *sum* to the step gradient.

        With exact accumulation the result of the step does not depend on the order of the
        calls, nor on how the groups were cut into micro-batches.

        Args:
            micro_batch: the experiences of complete GRPO groups of this agent.
            micro_batch_index: the micro-batch's index in the step's manifest (``MicroBatchWork``);
                with it, the same micro-batch delivered again (same index, same experiences) is
                not added twice: the call returns the first call's statistics. None: no check.
            step_stats: the return statistics of the agent's whole step (``MicroBatchWork``), needed
                by ``advantage_norm: agent``.

        Returns:
            Sizes and the un-normalised loss sum of this micro-batch.

        Raises:
            InvalidArgument: a group is incomplete; a group was accumulated already in this step;
                the index was accumulated already with other experiences.
        """
        started = time.perf_counter()
        experience_ids = tuple(sorted(r.experience_id for r in micro_batch))
        acc = self._acc
        if micro_batch_index is not None:
            seen = acc.indexed.get(micro_batch_index)
            if seen is not None:
                if seen.experience_ids != experience_ids:
                    raise InvalidArgument(f"agent {self.config.agent}: micro-batch {micro_batch_index} was "
                                          f"accumulated already in this step with other experiences")
                logger.info("agent %s: micro-batch %d delivered again; not added twice", self.config.agent,
                            micro_batch_index)
                return seen.stats
        groups = _groups_of(micro_batch)
        if not groups:
            raise InvalidArgument("empty micro-batch")
        again = sorted(acc.groups.intersection(groups))
        if again:
            raise InvalidArgument(f"agent {self.config.agent}: groups {again} were accumulated already in this step")
        units: list[tuple[tuple[str, ...], list[ExperienceRecord]]]
        if self.config.exact:
            units = [((gid,), groups[gid]) for gid in sorted(groups)]
        else:
            units = [(tuple(sorted(groups)), list(micro_batch))]
        # Incomplete groups fail here, before any gradient of this micro-batch is added.
        self._advantages(micro_batch, step_stats)
        computed = []
        try:
            for key, records in units:
                computed.append((key, self._backward(records, step_stats)))
        except BaseException:
            if computed:  # part of the micro-batch is in the gradient: the step cannot be completed
                acc.broken = True
            raise
        for key, (unit, _) in computed:
            acc.units[key] = unit
        acc.groups.update(groups)
        acc.micro_batches += 1
        if self.device_clock is not None:
            self.device_clock.train(started, sum(real_tokens for _, (_, real_tokens) in computed))
        stats = MicroBatchStats(
            sequences=sum(unit.sequences for _, (unit, _) in computed),
            response_tokens=sum(unit.tokens for _, (unit, _) in computed),
            loss_sum=math.fsum(unit.loss_sum for _, (unit, _) in computed),
            seconds=time.perf_counter() - started,
        )
        if micro_batch_index is not None:
            acc.indexed[micro_batch_index] = _MicroBatchSeen(experience_ids, stats)
        return stats

    def _advantages(self, records: Sequence[ExperienceRecord], step_stats: losses.ReturnStats | None) -> list[float]:
        cfg = self.config
        return micro_batch_advantages(records, cfg.advantage_norm, cfg.advantage_eps, baseline=cfg.turn_baseline,
                                      step_stats=step_stats)

    def _loss_config(self) -> losses.PolicyLossConfig:
        """The loss settings of the version being trained (the entropy schedule's coefficient)."""
        schedule = self.config.entropy_schedule
        if schedule is None:
            return self.config.loss
        return dataclasses.replace(self.config.loss, entropy_coef=schedule.at(self.version))

    def _backward(self, records: Sequence[ExperienceRecord],
                  step_stats: losses.ReturnStats | None = None) -> tuple[_UnitStats, float]:
        """Forward + backward of complete groups; returns their statistics and real (attended) tokens."""
        cfg = self.config
        loss_cfg = self._loss_config()
        advantages = self._advantages(records, step_stats)
        bound = cfg.stale_token_bound
        packed = pack_micro_batch(records, advantages,
                                  min_token_version=None if bound is None else self.version - bound)
        device = self.device
        input_ids = packed.input_ids.to(device)
        attention = packed.attention_mask.to(device)
        mask = packed.response_mask.to(device)
        ref_logprobs = None
        if loss_cfg.kl_coef > 0.0:
            with torch.no_grad():
                ref_logprobs = self._reference_logprobs(input_ids, attention)
        exact_sum = self._exact_sum
        # Exact: the bare module (ZeRO 0/1 need no engine forward), so that torch.autograd.grad
        # returns the group's gradient without DeepSpeed's backward hooks or its grad buffers.
        model = self.engine.module if exact_sum is not None else self.engine
        logprobs, entropy = token_logprobs_and_entropy(model, input_ids, attention, self.config.temperature,
                                                       entropy=loss_cfg.entropy_coef > 0.0)
        terms = losses.policy_loss_per_token(
            logprobs,
            packed.behavior_logprobs.to(device),
            packed.advantages.to(device),
            mask,
            loss_cfg,
            ref_logprobs,
            entropy,
        )
        loss_sum = losses.aggregate_sum(terms.loss, mask, loss_cfg.loss_agg)
        if exact_sum is not None:
            params = exact_sum.params
            grads = torch.autograd.grad(loss_sum, params, allow_unused=True)
            exact_sum.add(grads)
        else:
            self.engine.backward(loss_sum, scale_wrt_gas=False)
        unit = _UnitStats(
            loss_sum=float(loss_sum.detach().item()),
            tokens=int(mask.sum().item()),
            sequences=len(records),
            clipped_tokens=float(terms.clipped.sum().item()),
            kl_sum=float(terms.kl.sum().item()),
            ratio_sum=float(terms.ratio.sum().item()),
            stale_tokens=packed.stale_tokens,
        )
        return unit, float(attention.sum().item())

    def accumulate_loss(self, unit_key: tuple[str, ...], sequences: int,
                        compute: Callable[[Any], tuple[torch.Tensor, int]]) -> tuple[float, int]:
        """Adds one accumulation unit of another loss (a warm start's SFT loss, :mod:`traind.sft`).

        ``compute(model)`` returns the unit's loss *sum* and its token count. The gradient goes
        where :meth:`accumulate` puts it (the exact sum, or DeepSpeed's buffers), so
        :meth:`optimizer_step` normalises, clips and steps it the same way.

        Returns:
            The unit's loss sum and tokens.

        Raises:
            InvalidArgument: ``unit_key`` was accumulated already in this step.
        """
        acc = self._acc
        if unit_key in acc.units:
            raise InvalidArgument(f"agent {self.config.agent}: unit {unit_key} was accumulated already in this step")
        exact_sum = self._exact_sum
        model = self.engine.module if exact_sum is not None else self.engine
        loss_sum, tokens = compute(model)
        try:
            if exact_sum is not None:
                exact_sum.add(torch.autograd.grad(loss_sum, exact_sum.params, allow_unused=True))
            else:
                self.engine.backward(loss_sum, scale_wrt_gas=False)
        except BaseException:
            acc.broken = True
            raise
        value = float(loss_sum.detach().item())
        acc.units[unit_key] = _UnitStats(loss_sum=value, tokens=tokens, sequences=sequences, clipped_tokens=0.0,
                                         kl_sum=0.0, ratio_sum=0.0)
        acc.micro_batches += 1
        return value, tokens

    def _normalise_and_clip_hook(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        scale = self._pending_grad_scale
        if scale is None:
            raise FailedPrecondition("optimizer stepped outside AgentTrainer.optimizer_step")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        for grad in grads:
            grad.mul_(scale)
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for grad in grads:
            sq += grad.detach().float().pow(2).sum()
        if self.config.zero_stage >= 1 and self.world_size > 1:
            # ZeRO partitions the optimizer's flat fp32 params: each rank holds a disjoint slice.
            dist.all_reduce(sq, group=self.engine.data_parallel_group)
        norm = math.sqrt(float(sq.item()))
        self._last_grad_norm = norm
        if self.config.grad_clip > 0.0 and norm > self.config.grad_clip:
            coef = self.config.grad_clip / (norm + 1e-6)
            for grad in grads:
                grad.mul_(coef)

    def optimizer_step(self, step_response_tokens: int, step_sequences: int, *,
                       num_micro_batches: int | None = None) -> StepStats:
        """Normalises the accumulated gradient, clips, steps and zeroes it.

        Args:
            step_response_tokens: response tokens of the whole step over all DP ranks
                (the ``token-mean`` normaliser).
            step_sequences: experiences (sequences) of the whole step over all DP ranks
                (the ``seq-mean`` normaliser; equals the step's episodes for one turn per episode).
            num_micro_batches: micro-batches of the step's manifest (``OptimizerStepWork``): then
                the indices given to :meth:`accumulate` over all DP ranks must be exactly
                ``0 .. num_micro_batches - 1``, each on one rank. None: no check.

        Returns:
            Step statistics aggregated over the ranks.

        Raises:
            FailedPrecondition: a micro-batch of the manifest is missing or was accumulated on two
                ranks, or an ``accumulate`` failed half-way (nothing is stepped; every rank raises).
        """
        started = time.perf_counter()
        normaliser = losses.step_normaliser(self.config.loss.loss_agg, step_response_tokens, step_sequences)
        acc = self._acc
        shares = [(acc.units, sorted(acc.indexed), acc.broken)]
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, shares[0], group=self.engine.data_parallel_group)
            shares = gathered
        if any(broken for _, _, broken in shares):
            raise FailedPrecondition(f"agent {self.config.agent}: a micro-batch of this step failed half-way; "
                                     f"discard the gradients and replay the step")
        if num_micro_batches is not None:
            self._check_manifest(num_micro_batches, [indices for _, indices, _ in shares])
        units: dict[tuple[str, ...], _UnitStats] = {}
        for rank_units, _, _ in shares:
            units.update(rank_units)
        if len(units) != sum(len(rank_units) for rank_units, _, _ in shares):
            raise FailedPrecondition(f"agent {self.config.agent}: a group of this step was accumulated on several "
                                     f"ranks")
        ordered = [units[key] for key in sorted(units)]
        loss_sum = math.fsum(u.loss_sum for u in ordered)
        tokens = sum(u.tokens for u in ordered)
        sequences = sum(u.sequences for u in ordered)
        clipped = math.fsum(u.clipped_tokens for u in ordered)
        kl_sum = math.fsum(u.kl_sum for u in ordered)
        ratio_sum = math.fsum(u.ratio_sum for u in ordered)
        stale = sum(u.stale_tokens for u in ordered)
        if tokens + stale != step_response_tokens or sequences != step_sequences:
            logger.warning(
                "agent %s: step sizes given (%d tokens, %d sequences) differ from accumulated (%d, %d)",
                self.config.agent,
                step_response_tokens,
                step_sequences,
                tokens,
                sequences,
            )
        exact_sum = self._exact_sum
        if exact_sum is not None:
            if self.world_size > 1:
                exact_sum.all_reduce(self.engine.data_parallel_group)
            self._load_exact_gradient(exact_sum)
            # Every rank holds the whole step's sum. ZeRO 1/2 still average it over the ranks: the
            # mean of W equal values (exactly the value when W is a power of two).
            self._pending_grad_scale = 1.0 / normaliser
        else:
            # DeepSpeed averaged the gradients over the W ranks; the step wants sum / N.
            self._pending_grad_scale = self.world_size / normaliser
        try:
            self.engine.step()
        finally:
            self._pending_grad_scale = None
        self._zero_gradients()
        if self.device_clock is not None:
            self.device_clock.optimizer_step(started)
        token_count = float(max(tokens, 1))
        return StepStats(
            version=self.version,
            loss=loss_sum / normaliser,
            grad_norm=self._last_grad_norm,
            clip_fraction=clipped / token_count,
            kl=kl_sum / token_count,
            ratio_mean=ratio_sum / token_count,
            stale_tokens=stale,
            response_tokens=tokens,
            sequences=sequences,
            micro_batches=acc.micro_batches,
            seconds=time.perf_counter() - started,
        )

    def _load_exact_gradient(self, exact_sum: ExactGradientSum) -> None:
        """Puts the exact step sum where the engine's optimizer reads gradients."""
        pairs = [(p, g) for p, g in zip(exact_sum.params, exact_sum.result(), strict=True) if g is not None]
        if self.config.zero_stage == 0:
            for param, grad in pairs:
                param.grad = grad
            return
        # ZeRO 1/2 keep gradients in their own buckets, filled by backward hooks: one backward of
        # sum(p * g), whose gradient is exactly g (g * 1.0), puts the sum there on every rank.
        surrogate = torch.zeros((), dtype=torch.float32, device=self.device)
        for param, grad in pairs:
            surrogate = surrogate + (param * grad).sum()
        self.engine.backward(surrogate, scale_wrt_gas=False)

    def _check_manifest(self, num_micro_batches: int, indices_per_rank: Sequence[Sequence[int]]) -> None:
        counts: dict[int, int] = {}
        for indices in indices_per_rank:
            for index in indices:
                counts[index] = counts.get(index, 0) + 1
        missing = sorted(set(range(num_micro_batches)) - counts.keys())
        twice = sorted(i for i, n in counts.items() if n > 1)
        unknown = sorted(i for i in counts if not 0 <= i < num_micro_batches)
        if missing or twice or unknown:
            raise FailedPrecondition(
                f"agent {self.config.agent}: the step's {num_micro_batches} micro-batches were not each accumulated "
                f"once (missing {missing}, on several ranks {twice}, outside the manifest {unknown})"
            )

    def _zero_gradients(self) -> None:
        """Drops the step's gradient and statistics (the engine's buffers and the exact sums)."""
        self.engine.zero_grad()
        if self._exact_sum is not None:
            self._exact_sum.reset()
            for param in self._exact_sum.params:
                param.grad = None
        self._acc = _StepAccumulator()

    def discard_gradients(self) -> None:
        """Drops the accumulated (uncommitted) gradient, e.g. when a step is rolled back."""
        self._zero_gradients()
        if self.config.zero_stage >= 1:
            self.engine.optimizer.zero_grad()

    def accumulated_gradients(self) -> list[torch.Tensor | None]:
        """The step's un-normalised gradient so far, per trainable parameter (on this rank, before any reduction).

        For inspection (tests, benchmarks); with exact accumulation it is a copy of the exact sum.
        """
        if self._exact_sum is not None:
            return self._exact_sum.result()
        return [None if p.grad is None else p.grad.detach().clone()
                for p in self.engine.module.parameters() if p.requires_grad]

    # ------------------------------------------------------------ weights out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's full parameters on CPU (gathered under ZeRO 3); every rank must call it."""
        module = self.engine.module
        if self.config.zero_stage == 3:
            params = list(module.parameters())
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def publish(self, out_dir: str | os.PathLike[str]) -> Path:
        """Writes the weights as a Hugging Face safetensors checkpoint dir (config + tokenizer copied).

        A LoRA agent writes its adapter directory instead (``PeftModel.save_pretrained``:
        ``adapter_config.json`` + ``adapter_model.safetensors``, :mod:`traind.lora`).
        Every rank must call it (ZeRO 3 gathers); rank 0 writes. The directory appears
        atomically (written beside it, then renamed).

        Returns:
            The checkpoint directory.
        """
        target = Path(out_dir)
        state = self.full_state_dict() if self.config.lora is None else {}
        if self.rank == 0:
            staging = target.with_name(target.name + f".tmp-{os.getpid()}")
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
            if self.config.lora is not None:
                self.engine.module.save_pretrained(staging)
            else:
                self.engine.module.save_pretrained(staging, state_dict=state)
                copy_tokenizer_files(Path(self.config.model_path), staging)
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        if self.world_size > 1:
            dist.barrier()
        return target

    # ------------------------------------------------------------------ state

    def save_state(self, location: StateLocation) -> int:
        """Writes the full training state (params, optimizer, step, RNG) to a location.

        A LoRA agent's state holds its adapter, not the frozen base. Every rank must call it.
        Returns the bytes this rank moved.
        """
        if self._acc.units:
            raise FailedPrecondition(f"agent {self.config.agent}: cannot save mid-step")
        with location.writable_dir() as state_dir:
            self.engine.save_checkpoint(str(state_dir / "ds"), tag=CHECKPOINT_TAG,
                                        exclude_frozen_parameters=self.config.lora is not None)
            torch.save(
                {"rng": _capture_rng_state(), "version": self.version},
                state_dir / f"trainer-rank{self.rank:05d}.pt",
            )
            moved = directory_bytes(state_dir)
        return moved

    def load_state(self, location: StateLocation) -> int:
        """Restores the training state written by :meth:`save_state`. Returns bytes read."""
        if self._engine is None:
            self._build_engine()
        with location.readable_dir() as state_dir:
            # A LoRA state is the adapter alone (traind.lora checks that it is this agent's adapter).
            path, _ = self.engine.load_checkpoint(str(state_dir / "ds"), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                                  load_module_strict=self.config.lora is None)
            if path is None:
                raise FailedPrecondition(f"no DeepSpeed checkpoint in {location.uri}")
            extra_path = state_dir / f"trainer-rank{self.rank:05d}.pt"
            if not extra_path.exists() and self.config.zero_stage == 0:
                # A ZeRO 0 state saved by rank 0 alone (or at another world size) is complete in
                # rank 0's files; the other ranks take its RNG state.
                extra_path = state_dir / f"trainer-rank{0:05d}.pt"
            extra = torch.load(extra_path, weights_only=False)
            _restore_rng_state(extra["rng"])
            moved = directory_bytes(state_dir)
        self._zero_gradients()
        return moved

    def release(self) -> None:
        """Frees the engine (and the reference model); the slot's memory goes back.

        A LoRA agent's base goes back to the slot's cache, its adapter taken out.
        """
        if self._engine is not None:
            module = self._engine.module
            self._engine.destroy()
            self._engine = None
            self._return_base(module)
        self._reference = None
        self._acc = _StepAccumulator()
        if self._exact_sum is not None:
            self._exact_sum.free()
            self._exact_sum = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _return_base(self, module: Any) -> None:
        """A LoRA agent's base, its adapter taken out, back to the slot's cache (nothing for a full model)."""
        if self.config.lora is None:
            return
        base = lora.detach_adapter(module)
        if self._lora_bases is not None:
            self._lora_bases.give_back(base)

    @property
    def resident(self) -> bool:
        """Whether the engine is built in this slot."""
        return self._engine is not None


def copy_tokenizer_files(source: Path, target: Path) -> None:
    """Copies tokenizer/chat-template files of an HF checkpoint dir (not weights, not config)."""
    for path in source.iterdir():
        if not path.is_file() or path.suffix in WEIGHT_SUFFIXES or path.name in WEIGHT_INDEX_NAMES:
            continue
        if not (target / path.name).exists():
            shutil.copy2(path, target / path.name)
