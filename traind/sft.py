"""Warm starts: supervised fine-tuning of an agent on data its environment generates, before RL.

``agents[i].warm_start: {dataset: "module:attr", steps, lr, batch_size, config}`` names a callable
that, called with the job's ``seed`` and ``config`` (keywords), returns an iterable of (prompt, response) pairs, each
side text or token ids. traind takes ``steps * batch_size`` pairs in order; text is encoded the
way rolloutd encodes a text prompt (the agent's tokenizer, no special tokens) and a text
response gets the tokenizer's end-of-sequence token appended (so the agent learns to stop);
token ids are taken as they are.

The loss is the token-mean cross-entropy of the response tokens only (the prompt trains
nothing), and every step runs through the agent's own trainer
(:class:`traind.model.AgentTrainer`): its model, its AdamW settings at ``warm_start.lr``, its
DeepSpeed engine, its gradient clipping and, where it applies, exact accumulation (each chunk of
:data:`UNIT_EXAMPLES` examples is one accumulation unit, summed exactly). The examples and the
torch RNG (dropout) come from the job seed, so a warm start is bit-reproducible.

Where it fits the versions (docs/training.md, "Warm starts"): orchestratord issues one
``WarmStartWork`` per warm-start agent before it admits any rollout task; the slot builds the
agent's engine from its base checkpoint, runs the warm start, resets the engine's step count to
0 and the optimizer's moments, and publishes weights and state as version 0
(``TrainerWorker._warm_start``). Rolloutd then samples batch 0 with the warm-started weights, so
step 0 trains the policy that sampled it; RL starts with a fresh optimizer and v1 is the first RL
step. Every later engine comes from a committed or swapped-out state, which holds the warm start:
a replayed step, a resumed job or a swap-in never redoes it; a warm start issued again (its slot
died before the commit) redoes it, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from flexmarl.errors import FailedPrecondition, InvalidArgument
from flexmarl.jobspec import JobSpec
from flexmarl.warm_start_data import as_pair, first_items
from traind import losses
from traind.batches import token_logprobs

if TYPE_CHECKING:
    from traind.model import AgentTrainer

logger = logging.getLogger(__name__)

#: Examples per accumulation unit: the step's examples are cut into chunks of this many, in order.
UNIT_EXAMPLES = 8


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """One agent's warm start (``agents[i].warm_start`` with the job's seed)."""

    agent: str
    dataset: str
    steps: int
    lr: float
    batch_size: int
    seed: int
    #: Keyword arguments of the dataset callable besides ``seed`` (sorted (key, value) pairs).
    config: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, spec: JobSpec, agent: str) -> WarmStart | None:
        """The agent's warm start, or None when it has none."""
        warm = spec.agent(agent).warm_start
        if warm is None:
            return None
        return cls(agent=agent, dataset=warm.dataset, steps=warm.steps, lr=warm.lr, batch_size=warm.batch_size,
                   seed=spec.seed, config=tuple(sorted(warm.config.items())))

    @property
    def examples(self) -> int:
        """Examples the warm start reads: ``steps * batch_size``."""
        return self.steps * self.batch_size

    def torch_seed(self) -> int:
        """The torch seed of the warm start (dropout): from the job seed and the agent's name."""
        digest = hashlib.sha256(f"flexmarl-warm-start/{self.seed}/{self.agent}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclasses.dataclass(frozen=True)
class SftExample:
    """One supervised example: prompt tokens (condition only) and response tokens (trained)."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PackedSft:
    """Right-padded examples aligned to next-token logits (as :class:`traind.batches.PackedMicroBatch`)."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1], 1 where logits[:, t] predicts a response token


@dataclasses.dataclass(frozen=True)
class SftStep:
    """One warm-start optimizer step."""

    step: int
    loss: float  # token-mean cross-entropy of the step's response tokens (before the update)
    response_tokens: int
    grad_norm: float


@dataclasses.dataclass(frozen=True)
class WarmStartReport:
    """What a warm start did."""

    agent: str
    steps: tuple[SftStep, ...]
    seconds: float

    @property
    def first_loss(self) -> float:
        """The first step's loss."""
        return self.steps[0].loss

    @property
    def last_loss(self) -> float:
        """The last step's loss."""
        return self.steps[-1].loss


# ---- data ----------------------------------------------------------------------------------------


def to_example(item: Any, index: int, encode: Callable[[str], list[int]], eos_token_id: int | None) -> SftExample:
    """One dataset item as an example (text encoded, EOS after a text response); raises InvalidArgument."""
    prompt, response = as_pair(item, index)
    prompt_ids = encode(prompt) if isinstance(prompt, str) else prompt
    response_ids = encode(response) if isinstance(response, str) else response
    if isinstance(response, str) and eos_token_id is not None:
        response_ids = [*response_ids, eos_token_id]
    if not prompt_ids or not response_ids:
        raise InvalidArgument(f"warm-start example {index}: empty {'prompt' if not prompt_ids else 'response'} "
                              f"after tokenization")
    return SftExample(tuple(prompt_ids), tuple(response_ids))


def dataset_examples(warm: WarmStart, encode: Callable[[str], list[int]], eos_token_id: int | None,
                     ) -> list[SftExample]:
    """The warm start's ``steps * batch_size`` examples, in dataset order."""
    items = first_items(warm.dataset, warm.seed, warm.examples, dict(warm.config))
    return [to_example(item, i, encode, eos_token_id) for i, item in enumerate(items)]


def pack_examples(examples: Sequence[SftExample]) -> PackedSft:
    """Concatenates prompt + response per example and right-pads (pad id 0, masked out)."""
    if not examples:
        raise InvalidArgument("no warm-start examples to pack")
    lengths = [len(e.prompt_ids) + len(e.response_ids) for e in examples]
    width = max(lengths)
    input_ids = torch.zeros((len(examples), width), dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    response_mask = torch.zeros((len(examples), width - 1), dtype=torch.float32)
    for i, example in enumerate(examples):
        prompt_len = len(example.prompt_ids)
        input_ids[i, : lengths[i]] = torch.tensor(example.prompt_ids + example.response_ids, dtype=torch.long)
        attention[i, : lengths[i]] = 1
        response_mask[i, prompt_len - 1 : lengths[i] - 1] = 1.0
    return PackedSft(input_ids, attention, response_mask)


def sft_loss_sum(model: Any, packed: PackedSft) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of the response tokens (prompt tokens excluded) and their count.

    Divided by the step's response tokens it is the token-mean SFT loss.
    """
    device = next(model.parameters()).device
    mask = packed.response_mask.to(device)
    logprobs = token_logprobs(model, packed.input_ids.to(device), packed.attention_mask.to(device))
    return -(logprobs * mask).sum(), int(mask.sum().item())


def units_of(examples: Sequence[SftExample]) -> list[tuple[tuple[str, ...], list[SftExample]]]:
    """The step's accumulation units: consecutive chunks of :data:`UNIT_EXAMPLES`, keyed by position."""
    return [((f"sft/{start:08d}",), list(examples[start: start + UNIT_EXAMPLES]))
            for start in range(0, len(examples), UNIT_EXAMPLES)]


# ---- the trainer ---------------------------------------------------------------------------------


def sft_step(trainer: AgentTrainer, examples: Sequence[SftExample], step: int) -> SftStep:
    """One SFT optimizer step of the trainer over ``examples`` (token-mean over their response tokens)."""
    token_mean = dataclasses.replace(trainer.config, loss=dataclasses.replace(
        trainer.config.loss, loss_agg=losses.LossAggregation.TOKEN_MEAN))
    saved = trainer.config
    tokens = 0
    loss_sum = 0.0
    # The step normaliser is the response tokens whatever the agent's RL loss_agg is.
    trainer.config = token_mean
    try:
        for key, chunk in units_of(examples):
            packed = pack_examples(chunk)
            unit_loss, unit_tokens = trainer.accumulate_loss(key, len(chunk), functools.partial(sft_loss_sum,
                                                                                                packed=packed))
            loss_sum += unit_loss
            tokens += unit_tokens
        stats = trainer.optimizer_step(tokens, len(examples))
    finally:
        trainer.config = saved
    return SftStep(step=step, loss=loss_sum / max(tokens, 1), response_tokens=tokens, grad_norm=stats.grad_norm)


def _set_lr(trainer: AgentTrainer, lr: float) -> list[float]:
    groups = trainer.engine.optimizer.param_groups
    before = [float(group["lr"]) for group in groups]
    for group in groups:
        group["lr"] = lr
    return before


def reset_to_version_zero(trainer: AgentTrainer) -> None:
    """Returns the engine's step count to 0 and drops the optimizer's moments (RL starts fresh)."""
    engine = trainer.engine
    engine.global_steps = 0
    engine.global_samples = 0
    engine.basic_optimizer.state.clear()


def run_warm_start(trainer: AgentTrainer, warm: WarmStart,
                   on_step: Callable[[], None] = lambda: None) -> WarmStartReport:
    """Fine-tunes the trainer's agent on its warm-start data, then puts it back at version 0.

    ``on_step`` is called after each step (the slot's progress, which its lease renewals report).

    Raises:
        FailedPrecondition: the trainer is not a fresh version-0 engine of a world of one.
        InvalidArgument: the dataset does not load or yields an unusable example.
    """
    if trainer.version != 0:
        raise FailedPrecondition(f"agent {warm.agent}: a warm start needs a fresh engine, this one is at "
                                 f"v{trainer.version}")
    if trainer.world_size != 1:
        raise FailedPrecondition(f"agent {warm.agent}: warm starts run in a world of one (max_slots 1)")
    from transformers import AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(trainer.config.model_path, local_files_only=True)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    examples = dataset_examples(warm, encode, tokenizer.eos_token_id)
    rows: list[SftStep] = []
    lrs = _set_lr(trainer, warm.lr)
    # A warm start runs in real time: the modelled device (benchmarks) charges RL work only, so its
    # steps neither wait out modelled time nor appear in the device traces the clock starts from.
    clock, trainer.device_clock = trainer.device_clock, None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(warm.torch_seed())
            for step in range(warm.steps):
                batch = examples[step * warm.batch_size: (step + 1) * warm.batch_size]
                rows.append(sft_step(trainer, batch, step))
                on_step()
                if not math.isfinite(rows[-1].loss):
                    raise FailedPrecondition(f"agent {warm.agent}: warm-start loss is {rows[-1].loss} at step {step}")
    except BaseException:
        trainer.discard_gradients()
        raise
    finally:
        trainer.device_clock = clock
        for group, lr in zip(trainer.engine.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
    reset_to_version_zero(trainer)
    report = WarmStartReport(warm.agent, tuple(rows), time.perf_counter() - started)
    logger.info("agent %s: warm start of %d steps on %s: loss %.4f -> %.4f (%.2fs)", warm.agent, warm.steps,
                warm.dataset, report.first_loss, report.last_loss, report.seconds)
    return report
