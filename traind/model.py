"""AgentTrainer: one DeepSpeed engine for one agent, with step-exact gradient accumulation.

How the step gradient stays independent of micro-batching (DESIGN §3):

* DeepSpeed runs with ``gradient_accumulation_steps=1`` and
  ``managed_gradient_accumulation=false``: ``engine.backward(loss, scale_wrt_gas=False)``
  only adds into the gradient buffers (ZeRO 0/1 reduce in ``step()``, ZeRO 2/3 reduce
  per backward into partitions); nothing divides by a micro-step count.
* Every micro-batch loss is a plain sum (:mod:`traind.losses`); advantages come from
  complete groups inside the micro-batch.
* At ``optimizer_step`` the fixed normaliser ``N`` of the step (response tokens or
  sequences over all data-parallel ranks) is known. DeepSpeed's own clipping is off
  (``gradient_clipping=0``); a step pre-hook on the basic optimizer multiplies the
  reduced gradients by ``W / N`` (DeepSpeed averaged them over the ``W`` ranks), takes
  the global norm (all-reduced over the ranks when ZeRO partitions the optimizer) and
  clips to the job's ``grad_clip`` before the update.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import deepspeed
import deepspeed.comm as dist
import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from flexmarl.errors import FailedPrecondition, InvalidArgument
from flexmarl.experience import ExperienceRecord
from traind import losses
from traind.batches import micro_batch_advantages, pack_micro_batch, token_logprobs, token_logprobs_and_entropy
from traind.distributed import ensure_distributed
from traind.locations import StateLocation
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
        advantage_norm: GRPO ``std`` or ``mean``.
        advantage_eps: added to the group std.
        temperature: the agent's sampling temperature; logprobs are computed from logits / T
            to match the behaviour logprobs the engine reported (T <= 0, greedy, uses raw logits).
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
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise InvalidArgument(f"zero_stage must be 0..3, got {self.zero_stage}")
        if self.dtype not in ("fp32", "bf16"):
            raise InvalidArgument(f"dtype must be fp32 or bf16, got {self.dtype!r}")
        if self.grad_clip < 0.0 or self.lr < 0.0:
            raise InvalidArgument("grad_clip and lr must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The parameter dtype of the engine's module."""
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32


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


@dataclasses.dataclass
class _StepAccumulator:
    loss_sum: float = 0.0
    tokens: int = 0
    sequences: int = 0
    clipped_tokens: float = 0.0
    kl_sum: float = 0.0
    ratio_sum: float = 0.0
    micro_batches: int = 0


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

    def __init__(self, config: AgentTrainerConfig, device_clock: ModelledDeviceClock | None = None) -> None:
        """Loads the agent's checkpoint and builds its engine (initialises the process group if needed).

        Args:
            config: the agent's engine settings.
            device_clock: modelled device time (benchmarks): every micro-batch and optimizer step
                is charged to it and its owner settles it (real math still runs); None = real time only.
        """
        ensure_distributed()
        self.config = config
        self.device_clock = device_clock
        self._engine: Any = None
        self._reference: PreTrainedModel | None = None
        self._acc = _StepAccumulator()
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

    def _build_engine(self) -> None:
        cfg = self.config
        model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=cfg.torch_dtype)
        model.config.use_cache = False
        optimizer: torch.optim.Optimizer | None = None
        if cfg.optimizer_impl is OptimizerImpl.TORCH:
            # One param group: ZeRO steps group by group and the clip norm must span all of them.
            optimizer = torch.optim.AdamW(
                model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
            )
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            model_parameters=None if optimizer is not None else model.parameters(),
            config=self._ds_config(),
        )
        self._engine = engine
        engine.basic_optimizer.register_step_pre_hook(self._normalise_and_clip_hook)
        engine.train()
        logger.info(
            "agent %s: engine built (zero=%d dtype=%s optimizer=%s world=%d)",
            cfg.agent,
            cfg.zero_stage,
            cfg.dtype,
            type(engine.optimizer).__name__,
            engine.dp_world_size,
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

    def _reference_model(self) -> PreTrainedModel:
        """The frozen initial policy for the KL term, rebuilt from the checkpoint dir on demand."""
        if self._reference is None:
            ref: Any = AutoModelForCausalLM.from_pretrained(self.config.model_path, dtype=self.config.torch_dtype)
            ref.requires_grad_(False)
            self._reference = ref.to(self.device).eval()
        return self._reference

    # --------------------------------------------------------------- training

    def accumulate(self, micro_batch: Sequence[ExperienceRecord]) -> MicroBatchStats:
        """Forward + backward of one micro-batch of complete groups; adds its loss *sum* to the grads.

        Args:
            micro_batch: the experiences of complete GRPO groups of this agent.

        Returns:
            Sizes and the un-normalised loss sum of this micro-batch.
        """
        started = time.perf_counter()
        cfg = self.config
        advantages = micro_batch_advantages(micro_batch, cfg.advantage_norm, cfg.advantage_eps)
        packed = pack_micro_batch(micro_batch, advantages)
        device = self.device
        input_ids = packed.input_ids.to(device)
        attention = packed.attention_mask.to(device)
        mask = packed.response_mask.to(device)
        ref_logprobs = None
        if cfg.loss.kl_coef > 0.0:
            with torch.no_grad():
                ref_logprobs = token_logprobs(self._reference_model(), input_ids, attention,
                                              self.config.temperature)
        logprobs, entropy = token_logprobs_and_entropy(self.engine, input_ids, attention, self.config.temperature,
                                                       entropy=cfg.loss.entropy_coef > 0.0)
        terms = losses.policy_loss_per_token(
            logprobs,
            packed.behavior_logprobs.to(device),
            packed.advantages.to(device),
            mask,
            cfg.loss,
            ref_logprobs,
            entropy,
        )
        loss_sum = losses.aggregate_sum(terms.loss, mask, cfg.loss.loss_agg)
        self.engine.backward(loss_sum, scale_wrt_gas=False)
        tokens = int(mask.sum().item())
        if self.device_clock is not None:
            self.device_clock.train(started, float(attention.sum().item()))
        acc = self._acc
        acc.loss_sum += float(loss_sum.detach().item())
        acc.tokens += tokens
        acc.sequences += len(micro_batch)
        acc.clipped_tokens += float(terms.clipped.sum().item())
        acc.kl_sum += float(terms.kl.sum().item())
        acc.ratio_sum += float(terms.ratio.sum().item())
        acc.micro_batches += 1
        return MicroBatchStats(
            sequences=len(micro_batch),
            response_tokens=tokens,
            loss_sum=float(loss_sum.detach().item()),
            seconds=time.perf_counter() - started,
        )

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

    def optimizer_step(self, step_response_tokens: int, step_sequences: int) -> StepStats:
        """Normalises the accumulated gradient, clips, steps and zeroes it.

        Args:
            step_response_tokens: response tokens of the whole step over all DP ranks
                (the ``token-mean`` normaliser).
            step_sequences: experiences (sequences) of the whole step over all DP ranks
                (the ``seq-mean`` normaliser; equals the step's episodes for one turn per episode).

        Returns:
            Step statistics aggregated over the ranks.
        """
        started = time.perf_counter()
        normaliser = losses.step_normaliser(self.config.loss.loss_agg, step_response_tokens, step_sequences)
        acc = self._acc
        totals = torch.tensor(
            [acc.loss_sum, acc.tokens, acc.sequences, acc.clipped_tokens, acc.kl_sum, acc.ratio_sum],
            dtype=torch.float64,
        )
        if self.world_size > 1:
            totals_dev = totals.to(self.device)
            dist.all_reduce(totals_dev, group=self.engine.data_parallel_group)
            totals = totals_dev.cpu()
        loss_sum, tokens, sequences, clipped, kl_sum, ratio_sum = totals.tolist()
        if int(tokens) != step_response_tokens or int(sequences) != step_sequences:
            logger.warning(
                "agent %s: step sizes given (%d tokens, %d sequences) differ from accumulated (%d, %d)",
                self.config.agent,
                step_response_tokens,
                step_sequences,
                int(tokens),
                int(sequences),
            )
        # DeepSpeed averaged the gradients over the W ranks; the step wants sum / N.
        self._pending_grad_scale = self.world_size / normaliser
        try:
            self.engine.step()
        finally:
            self._pending_grad_scale = None
        self.engine.zero_grad()
        self._acc = _StepAccumulator()
        if self.device_clock is not None:
            self.device_clock.optimizer_step(started)
        token_count = max(tokens, 1.0)
        return StepStats(
            version=self.version,
            loss=loss_sum / normaliser,
            grad_norm=self._last_grad_norm,
            clip_fraction=clipped / token_count,
            kl=kl_sum / token_count,
            ratio_mean=ratio_sum / token_count,
            response_tokens=int(tokens),
            sequences=int(sequences),
            micro_batches=acc.micro_batches,
            seconds=time.perf_counter() - started,
        )

    def discard_gradients(self) -> None:
        """Drops the accumulated (uncommitted) gradient, e.g. when a step is rolled back."""
        self.engine.zero_grad()
        if self.config.zero_stage >= 1:
            self.engine.optimizer.zero_grad()
        self._acc = _StepAccumulator()

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

        Every rank must call it (ZeRO 3 gathers); rank 0 writes. The directory appears
        atomically (written beside it, then renamed).

        Returns:
            The checkpoint directory.
        """
        target = Path(out_dir)
        state = self.full_state_dict()
        if self.rank == 0:
            staging = target.with_name(target.name + f".tmp-{os.getpid()}")
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
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

        Every rank must call it. Returns the bytes this rank moved.
        """
        if self._acc.micro_batches:
            raise FailedPrecondition(f"agent {self.config.agent}: cannot save mid-step")
        with location.writable_dir() as state_dir:
            self.engine.save_checkpoint(str(state_dir / "ds"), tag=CHECKPOINT_TAG)
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
            path, _ = self.engine.load_checkpoint(str(state_dir / "ds"), tag=CHECKPOINT_TAG, load_optimizer_states=True)
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
        self._acc = _StepAccumulator()
        return moved

    def release(self) -> None:
        """Frees the engine (and the reference model); the slot's memory goes back."""
        if self._engine is not None:
            self._engine.destroy()
            self._engine = None
        self._reference = None
        self._acc = _StepAccumulator()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

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
