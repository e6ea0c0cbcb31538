"""The job spec shared by the SDK/CLI and orchestratord.

A job spec is YAML or JSON; :func:`load_job_spec` parses and validates it and
raises :class:`flexmarl.errors.InvalidArgument` with one line per problem,
each naming the field path and the reason, e.g.
``batch.micro_batch_size: must be a multiple of batch.group_size (4), got 6``.
Unknown keys are rejected everywhere so that a typo never silently falls back
to a default.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from flexmarl import ids
from flexmarl.errors import FailedPrecondition, InvalidArgument
from flexmarl.jobspec_errors import format_errors

AGENT_NAME_PATTERN = rf"^{ids.AGENT_NAME_PATTERN}$"
JOB_NAME_PATTERN = rf"^{ids.JOB_ID_PATTERN}$"  # a job's name is its job id's prefix
# "package.module:attr.sub" — the environment class or factory to load.
_DOTTED_NAME = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
ENTRYPOINT_PATTERN = rf"^{_DOTTED_NAME}:{_DOTTED_NAME}$"
MAX_AGENTS = 64
MAX_TOTAL_STEPS = 10_000_000
#: The most rollout tasks one LeaseRolloutTasks call may ask for: orchestratord refuses more, and a rolloutd whose
#: limit is larger (a job's rollout_tasks_ahead can be) asks in several calls.
MAX_TASKS_PER_LEASE = 256

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeFloat = Annotated[float, Field(ge=0.0)]


class _SpecModel(BaseModel):
    """Base: unknown keys rejected, no silent coercion of strings to numbers, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


SHA256_PATTERN = r"^([0-9a-f]{64})?$"
#: The branches of a one-or-many union (their tags, which error locations leave out: _format_location).
ONE, MANY = "one", "a list"


def _one_or_many(value: Any) -> str | None:
    return MANY if isinstance(value, list) else ONE if isinstance(value, str) else None


#: A task file, or a list of them (verl's `data.train_files`): rows concatenated in list order.
TaskFiles = Annotated[
    Annotated[Annotated[str, Field(min_length=1)], Tag(ONE)]
    | Annotated[Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)], Tag(MANY)],
    Discriminator(_one_or_many, custom_error_type="task_files",
                  custom_error_message="must be a file path or a list of file paths"),
]
#: The sha256 of a task file's content, or of each of a list's (in its order); "" or []: not recorded.
TaskFileDigests = Annotated[
    Annotated[Annotated[str, Field(pattern=SHA256_PATTERN)], Tag(ONE)]
    | Annotated[list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]], Tag(MANY)],
    Discriminator(_one_or_many, custom_error_type="task_file_digests",
                  custom_error_message="must be a sha256 or a list of them"),
]


class DatasetSpec(_SpecModel):
    """Task files (docs/environments.md, "An environment over a dataset"): task i of the job is a row of `train`.

    Each file is JSON Lines (`.jsonl`, one JSON object a line), Parquet (`.parquet`) or a Hugging Face
    `datasets` directory written by `save_to_disk`. It must be on a filesystem every rolloutd host sees,
    at the same path (as the environment's code is); `flexmarl submit` reads it too. `train` and `eval`
    each take one file or a list of files, whose rows are concatenated in list order.
    """

    train: TaskFiles
    """The training tasks: a file or `save_to_disk` directory, or a list of them (rows concatenated in list
    order, then shuffled per epoch); a relative path is relative to the job file (`flexmarl submit` makes it
    absolute)."""
    eval: TaskFiles | None = None
    """Held-out tasks (a file or a list, as `train`), played in file order by evaluation (`Environment.eval_task`),
    never trained on; unset: evaluation draws tasks the environment's way (for a dataset: `train` rows in
    another order, not held out)."""
    fields: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    """The fields the environment reads: every row must have each (not null); submit refuses a file with a row
    that lacks one, rolloutd skips (and counts) such a row of a file that changed meanwhile."""
    shuffle: bool = True
    """Play each epoch in its own order, a permutation drawn from the job's `seed` and the epoch (every row once
    per epoch); false: file order."""
    epochs: Annotated[int, Field(ge=1)] | None = None
    """At most this many passes over `train`: submit refuses a job whose total_steps x prompts_per_step tasks
    need more; unset: the file repeats as often as the job needs (each pass in a fresh order)."""
    train_sha256: TaskFileDigests = ""
    """Set by `flexmarl submit`: sha256 of `train`'s content (a list of them, one per file, for a list);
    rolloutd refuses a file that no longer matches (a given value must match at submit too)."""
    eval_sha256: TaskFileDigests = ""
    """Set by `flexmarl submit`: sha256 of `eval`'s content (as `train_sha256`)."""

    @field_validator("fields")
    @classmethod
    def _distinct_fields(cls, value: list[str]) -> list[str]:
        duplicates = sorted({name for name in value if value.count(name) > 1})
        if duplicates:
            raise ValueError(f"each field at most once, got {duplicates} twice")
        return value

    @model_validator(mode="after")
    def _digests_match_files(self) -> DatasetSpec:
        for split in ("train", "eval"):
            files, digests = getattr(self, split), getattr(self, f"{split}_sha256")
            if not digests:
                continue
            if files is None:
                raise ValueError(f"{split}_sha256: given without {split}")
            if isinstance(files, str) != isinstance(digests, str):
                raise ValueError(f"{split}_sha256: one sha256 per file of {split}: "
                                 f"{'a string' if isinstance(files, str) else f'a list of {len(files)}'}")
            if isinstance(files, list) and len(files) != len(digests):
                raise ValueError(f"{split}_sha256: {len(digests)} sha256s for the {len(files)} files of {split}")
        return self

    def listed(self, split: Literal["train", "eval"]) -> bool:
        """Whether ``split`` names a list of files (a list stays a list when pinned, one file a string)."""
        return isinstance(getattr(self, split), list)

    def files(self, split: Literal["train", "eval"]) -> list[tuple[str, str]]:
        """(path, recorded sha256 or "") of each file of ``split``, in list order (none for an unset eval)."""
        files, digests = getattr(self, split), getattr(self, f"{split}_sha256")
        if files is None:
            return []
        if isinstance(files, str):
            return [(files, str(digests))]
        return [(path, digests[i] if digests else "") for i, path in enumerate(files)]

    def describe(self, split: Literal["train", "eval"]) -> str:
        """``split``'s files for a message: the path, or ``a, b (2 files)``."""
        paths = [path for path, _ in self.files(split)]
        return paths[0] if len(paths) == 1 else f"{', '.join(paths)} ({len(paths)} files)"


class EnvironmentSpec(_SpecModel):
    """The environment class and its constructor kwargs."""

    entrypoint: str
    """The environment class, `package.module:Class`, importable by rolloutd (and by `flexmarl submit`'s preflight)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    code_digest: Annotated[str, Field(pattern=r"^(sha256:[0-9a-f]{64})?$")] = ""
    """Set by `flexmarl submit`'s preflight: the sha256 of the entrypoint module's source file it checked.
    rolloutd refuses the job when the module it runs (imported earlier, then edited) is another; empty: not compared."""
    dataset: DatasetSpec | None = None
    """Tasks read from files: `Environment.task` returns row i of the train file's order (docs/environments.md,
    "An environment over a dataset"); unset: the environment makes its tasks in code."""

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, value: str) -> str:
        if not re.match(ENTRYPOINT_PATTERN, value):
            raise ValueError(f"must have the form 'package.module:attr', got {value!r}")
        return value


class SamplingSpec(_SpecModel):
    """Sampling parameters of an agent's generations."""

    temperature: NonNegativeFloat = 1.0
    """Sampling temperature (0: greedy); the trainer scores tokens under the same temperature-scaled distribution."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    """Nucleus sampling: smallest set of tokens whose probability reaches top_p."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 turns it off."""
    max_new_tokens: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    """Most tokens one turn generates (an episode may ask for fewer)."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """Token ids that end a turn besides the tokenizer's EOS."""

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"must be -1 (off) or >= 1, got {value}")
        return value


class OptimizerSpec(_SpecModel):
    """Optimizer of an agent."""

    name: Literal["adamw", "adam", "sgd"] = "adamw"
    """Optimizer (AdamW, Adam or SGD) of the agent's trainable parameters."""
    lr: Annotated[float, Field(gt=0.0)] = 1.0e-5
    """Learning rate."""
    betas: Annotated[list[Annotated[float, Field(ge=0.0, lt=1.0)]], Field(min_length=2, max_length=2)] = Field(
        default_factory=lambda: [0.9, 0.999]
    )
    """Adam's (beta1, beta2)."""
    eps: Annotated[float, Field(gt=0.0)] = 1.0e-8
    """Adam's epsilon."""
    weight_decay: NonNegativeFloat = 0.0
    """Decoupled weight decay (AdamW)."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the step's global gradient norm to this; 0 turns clipping off."""


class WarmStartSpec(_SpecModel):
    """A supervised fine-tune of the agent on generated data, run by traind before its first RL step."""

    dataset: str
    """The data, `package.module:attr`: a callable that, called with `seed=` the job's seed, returns an iterable of
    (prompt, response) pairs, each text or a list of token ids (a text response gets the end-of-sequence token)."""
    steps: PositiveInt
    """SFT optimizer steps (each over `batch_size` examples, in the dataset's order)."""
    lr: Annotated[float, Field(gt=0.0)] = 1.0e-3
    """Learning rate of the SFT steps (the agent's other optimizer settings apply)."""
    batch_size: Annotated[int, Field(ge=1, le=1_000_000)] = 32
    """Examples per SFT step; the loss is the token-mean cross-entropy of their response tokens."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the dataset callable besides `seed` (e.g. the environment's operand range)."""

    @field_validator("dataset")
    @classmethod
    def _dataset_form(cls, value: str) -> str:
        if not re.match(ENTRYPOINT_PATTERN, value):
            raise ValueError(f"must have the form 'package.module:attr', got {value!r}")
        return value


MAX_LORA_RANK = 1024
_MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$"


class LoraSpec(_SpecModel):
    """A LoRA adapter trained over a frozen base model (PEFT's `LoraConfig`; docs/training.md, "LoRA agents")."""

    rank: Annotated[int, Field(ge=1, le=MAX_LORA_RANK)]
    """The adapter's rank r (PEFT `r`)."""
    alpha: Annotated[int, Field(ge=1)] = 16
    """The LoRA scaling numerator, an integer: the update is (alpha / rank) * B A (PEFT `lora_alpha`)."""
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    """Dropout on the adapter's input while training (PEFT `lora_dropout`)."""
    target_modules: Annotated[list[Annotated[str, Field(pattern=_MODULE_NAME)]], Field(min_length=1)]
    """Names (or name suffixes) of the base's linear modules that get an adapter, e.g. `[q_proj, v_proj]`
    (PEFT `target_modules`)."""

    @field_validator("target_modules")
    @classmethod
    def _distinct_modules(cls, value: list[str]) -> list[str]:
        duplicates = sorted({m for m in value if value.count(m) > 1})
        if duplicates:
            raise ValueError(f"each module at most once, got {duplicates} twice")
        return value


class AgentSpec(_SpecModel):
    """One agent: its own policy, sampling and optimizer."""

    name: Annotated[str, Field(pattern=AGENT_NAME_PATTERN)]
    """The agent's name, as the environment calls it."""
    model: Annotated[str, Field(min_length=1)]
    """A Hugging Face checkpoint directory, or `tiny://<arch>?seed=N` for a tiny random-init model built locally.
    For a LoRA agent (`lora`), its frozen base, which the spec may also give as `base:`."""
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    """How the agent's turns are sampled."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    """How the agent's policy is trained."""
    zero_stage: Annotated[int, Field(ge=0, le=3)] = 0
    """DeepSpeed ZeRO stage of the agent's engine (0-3)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter and compute dtype of the agent's training engine."""
    max_slots: Annotated[int, Field(ge=1, le=1024)] = 1
    """Trainer slots the agent may train on at once (data-parallel when > 1)."""
    algorithm: AgentAlgorithmSpec = Field(default_factory=lambda: AgentAlgorithmSpec())
    """The agent's own credit-assignment and exploration settings over the job's `algorithm`."""
    exact_accumulation: bool = True
    """Sum each step's group gradients exactly (int64 fixed point), so the result does not depend on the
    order micro-batches arrive in: strict async equals sync bit for bit. Costs 16 bytes per trainable
    parameter while the agent is resident (docs/pipeline.md); fp32 with ZeRO 0-2 only (bf16 and ZeRO 3
    keep DeepSpeed's arrival-order sum)."""
    warm_start: WarmStartSpec | None = None
    """Supervised warm start before RL (docs/training.md, "Warm starts"); unset: RL starts from `model`."""
    lora: LoraSpec | None = None
    """Train only a LoRA adapter over `model`, its frozen base (which the spec may also call `base`); agents
    with the same base share one copy of it on a trainer slot. Unset: the whole model trains."""

    @model_validator(mode="before")
    @classmethod
    def _base_is_model(cls, data: Any) -> Any:
        """`base: X` (with `lora`) is another spelling of `model: X`."""
        if not isinstance(data, Mapping) or "base" not in data:
            return data
        if "model" in data:
            raise ValueError("give model or base (its name for a LoRA agent's base), not both")
        if data.get("lora") is None:
            raise ValueError("base: names the base model of a LoRA agent; give lora too, or say model")
        rest = {k: v for k, v in data.items() if k != "base"}
        return {**rest, "model": data["base"]}


AdvantageNormName = Literal["std", "mean", "agent", "none"]


class AlgorithmSpec(_SpecModel):
    """The RL algorithm and its loss options."""

    name: Literal["grpo", "ppo"] = "grpo"
    """`grpo`: group-relative advantages, needs batch.group_size >= 2. `ppo`: the same clipped
    surrogate without that check (no critic is trained: advantages are still relative to the task's group)."""
    clip_eps: Annotated[float, Field(gt=0.0)] = 0.2
    """PPO clip range epsilon of the importance ratio."""
    kl_coef: NonNegativeFloat = 0.0
    """Weight of the KL penalty to the initial (reference) policy; 0 turns it off."""
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    """`token-mean`: the step's loss is averaged over response tokens; `seq-mean`: over sequences."""
    advantage_norm: AdvantageNormName = "std"
    """`std`: (G - mean) / std within a task's group; `mean`: G - mean; `agent` (Dr. MAS): (G - mean) / std over
    every experience of the agent's step (its micro-batches wait for the whole step's rewards); `none`: the return G
    itself. G is a turn's return (docs/training.md, "Credit assignment")."""
    turn_baseline: Literal["episode", "turn"] = "episode"
    """The group statistics of `std` / `mean`: `episode`, each episode's return from the agent's first turn; `turn`,
    the returns of the group's turns with the same turn index (for turn-level rewards)."""
    gamma: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    """Discount over an agent's turns: a turn's return is the sum of the agent's rewards from that turn on, the one
    k turns later weighted gamma**k (episode-level rewards count at the agent's last turn)."""
    entropy_coef: NonNegativeFloat = 0.0
    """Entropy bonus: the loss subtracts entropy_coef times the policy's entropy at each response token (the
    coefficient of step 0 when entropy_coef_end is set)."""
    entropy_coef_end: NonNegativeFloat | None = None
    """Entropy schedule: the coefficient moves linearly from entropy_coef to this over entropy_decay_steps steps,
    then stays; unset: entropy_coef throughout."""
    entropy_decay_steps: Annotated[int, Field(ge=0)] = 0
    """Steps of the entropy schedule (0: no schedule)."""
    proximal_policy: Literal["behaviour", "trainer"] = "behaviour"
    """What the PPO clip keeps each update close to. `behaviour`: the policy that sampled each token (plain PPO-clip;
    under staleness, a token whose probability already moved past the clip range while it waited gets no gradient).
    `trainer`: decoupled PPO (AReaL's `use_decoupled_loss`): the clip is around the trainer's weights at the start of
    the step and each token is weighted by its behaviour importance weight pi_trainer / pi_behaviour (no extra forward
    pass: one optimizer step per version). Meant for `pipeline.max_staleness` > 0 (docs/training.md, "Off-policy
    correction")."""
    behaviour_weight_cap: Annotated[float, Field(gt=1.0)] = 5.0
    """With `proximal_policy: trainer`, tokens whose behaviour importance weight exceeds this are left out of the loss
    (AReaL's `behav_imp_weight_cap`); unused with `behaviour`."""


class AgentAlgorithmSpec(_SpecModel):
    """One agent's overrides of the job's `algorithm` (unset fields keep the job's value)."""

    kl_coef: NonNegativeFloat | None = None
    """The agent's `algorithm.kl_coef`."""
    advantage_norm: AdvantageNormName | None = None
    """The agent's `algorithm.advantage_norm`."""
    turn_baseline: Literal["episode", "turn"] | None = None
    """The agent's `algorithm.turn_baseline`."""
    gamma: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """The agent's `algorithm.gamma`."""
    entropy_coef: NonNegativeFloat | None = None
    """The agent's `algorithm.entropy_coef`."""
    entropy_coef_end: NonNegativeFloat | None = None
    """The agent's `algorithm.entropy_coef_end`."""
    entropy_decay_steps: Annotated[int, Field(ge=0)] | None = None
    """The agent's `algorithm.entropy_decay_steps`."""


class BatchSpec(_SpecModel):
    """Sizes of one step: tasks (prompts), episodes per task, episodes per micro-batch."""

    prompts_per_step: PositiveInt
    """Tasks (prompts) of one rollout batch, i.e. of one training step."""
    group_size: PositiveInt
    """Episodes per task (GRPO's group)."""
    micro_batch_size: PositiveInt
    """Episodes per micro-batch; a multiple of group_size and at most prompts_per_step * group_size."""

    @property
    def episodes_per_step(self) -> int:
        """Episodes (samples) per rollout batch: B in the admission rule."""
        return self.prompts_per_step * self.group_size

    @property
    def groups_per_micro_batch(self) -> int:
        """Complete groups (tasks) per micro-batch."""
        return self.micro_batch_size // self.group_size


PipelineMode = Literal["async", "sync", "sequential", "static"]
BindingPolicy = Literal["dynamic", "static"]
StepFill = Literal["batch", "completion"]
BalancingPolicy = Literal["hierarchical", "static", "round-robin"]
WeightSyncMode = Literal["distributed", "disk"]
BARRIER_MODES = ("sync", "sequential", "static")


class PipelineSpec(_SpecModel):
    """Pipeline mode, staleness bound and trainer-slot binding.

    Modes (``docs/pipeline.md`` has the details):

    * ``async``: micro-batches train as soon as their groups are complete (FlexMARL).
    * ``sync``: the barrier baseline: a batch is generated whole, then trained.
    * ``sequential``: ``sync`` plus agents train one after another (MAS-RL-like).
    * ``static``: ``sync`` with every agent on a fixed slot set and a fixed replica
      share (MARTI-like); implies ``binding: static`` and ``rollout.balancing: static``.

    ``binding`` (``dynamic``: agent-centric on-demand binding; ``static``: each
    agent only on its fixed slot set) defaults to ``static`` in mode ``static``
    and ``dynamic`` otherwise. Barrier modes admit batch t + 1 only after every
    agent committed step t, so they train on-policy whatever ``max_staleness`` says.
    """

    mode: PipelineMode = "async"
    """`async` (FlexMARL), `sync`, `sequential` or `static` (see docs/pipeline.md)."""
    max_staleness: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    """How many versions behind the trained policy an experience's behaviour policy may be; 0 is strict on-policy."""
    binding: BindingPolicy | None = None
    """`dynamic` (agent-centric on-demand binding) or `static` (fixed slots); default follows the mode."""
    step_fill: StepFill = "batch"
    """Which tasks form step t: `batch` (rollout batch t, tasks t x prompts_per_step onwards; every mode) or
    `completion` (the first prompts_per_step tasks to finish that no earlier step took, so a long episode no
    longer holds its step back: AReaL's and slime's partial rollout; async mode with max_staleness >= 1 only).
    Under `completion` a task whose oldest token would be more than max_staleness versions behind its step
    holds that step open until it finishes, unless `rollout.mask_stale_tokens` (then it joins the next step
    and its stale tokens get zero weight); docs/pipeline.md."""

    @property
    def fills_by_completion(self) -> bool:
        """Whether a step is the first tasks to finish (``step_fill: completion``), not its rollout batch."""
        return self.step_fill == "completion"

    @property
    def barrier(self) -> bool:
        """Whether a rollout batch is generated whole before any of it trains."""
        return self.mode in BARRIER_MODES

    @property
    def effective_binding(self) -> BindingPolicy:
        """The binding policy after the mode's default is applied."""
        if self.binding is not None:
            return self.binding
        return "static" if self.mode == "static" else "dynamic"


class RolloutSpec(_SpecModel):
    """How rolloutd balances generation requests over engine replicas.

    ``hierarchical``: replicas follow each agent's demand and requests go to the
    least-loaded replica of their agent (FlexMARL); ``static``: each agent keeps
    its initial equal share of replicas, least-loaded routing within it;
    ``round-robin``: equal shares and load-oblivious round-robin routing. With
    more agents than replicas (a second job, or an on-demand evaluation round's
    agents beside the job's) an agent dealt no replica takes one from an agent
    without demand once its requests wait, under every policy.
    Defaults to ``static`` in ``pipeline.mode: static``, else ``hierarchical``.
    """

    balancing: BalancingPolicy | None = None
    """`hierarchical`, `static` or `round-robin`; default `static` in mode static, else `hierarchical`."""
    partial_rollout: bool = False
    """A new published version of an agent interrupts that agent's in-flight generations: its replicas pause,
    load the new version and the sequences go on from the tokens they have (needs mode async and
    `pipeline.max_staleness` >= 1; docs/rollout.md)."""
    mask_stale_tokens: bool = False
    """Tokens sampled more than `pipeline.max_staleness` versions before the version being trained get zero
    weight in the loss (slime's --mask-offpolicy-in-partial-rollout; needs `partial_rollout`)."""
    weight_sync: WeightSyncMode = "disk"
    """How a new version reaches the replicas: `disk` (each replica loads the published checkpoint) or
    `distributed` (the trainer broadcasts it to the replicas over a weight-update group, the checkpoint is
    written beside it; a replica that misses the broadcast loads the checkpoint; docs/engines.md)."""


class LeaseSpec(_SpecModel):
    """Lease timeouts of rollout tasks and trainer work."""

    rollout_timeout_s: Annotated[float, Field(gt=0.0, le=86_400.0)] = 60.0
    """Seconds a rollout task's lease lasts without renewal before the task is re-issued."""
    train_timeout_s: Annotated[float, Field(gt=0.0, le=86_400.0)] = 120.0
    """Seconds a micro-batch's lease lasts without renewal before it is re-issued (traind renews it while it
    works on it, warm start and swap-in included)."""
    progress_timeout_s: Annotated[float, Field(ge=0.0, le=86_400.0)] = 600.0
    """Seconds a lease is renewed while its work shows no progress (no token generated for a rollout task, no
    pass done for trainer work); then it is not extended, and the work is re-issued (a hung engine or training
    step). It must exceed the longest single unit: one generation call of an episode, a weight load, one
    micro-batch pass or warm-start step, a swap-in. 0 turns the check off (docs/reliability.md, Hung workers)."""


class CheckpointSpec(_SpecModel):
    """What traind keeps of each agent's versions (published weights and training states).

    A version's weights are kept while it is one of the ``keep_last`` newest, or a multiple of
    ``keep_every``; its training state while it is one of the ``keep_states`` newest, or a
    multiple of ``keep_every`` (so every long-kept version can also be resumed from). The latest
    committed version is never pruned, and version 0 is the spec's own model. Each version kept
    with both its weights and its state has a manifest beside it and can be resumed from, on
    this cluster or a new one (`flexmarl resume`).
    """

    keep_last: Annotated[int, Field(ge=1, le=1_000_000)] = 3
    """Published weights of the newest keep_last versions are kept (the latest is never pruned)."""
    keep_every: Annotated[int, Field(ge=0, le=MAX_TOTAL_STEPS)] = 0
    """Also keep every M-th version forever, weights and training state; 0 keeps none extra."""
    keep_states: Annotated[int, Field(ge=1, le=1_000_000)] = 1
    """Training states (optimizer included) of the newest keep_states versions are kept."""

    def keeps_weights(self, version: int, latest: int) -> bool:
        """Whether ``version``'s published weights are retained once ``latest`` is committed."""
        return version == 0 or version > latest - self.keep_last or self._kept_forever(version)

    def keeps_state(self, version: int, latest: int) -> bool:
        """Whether ``version``'s training state is retained once ``latest`` is committed."""
        return version > latest - self.keep_states or self._kept_forever(version)

    def prune_candidates(self, latest: int) -> range:
        """The versions below ``latest`` that may have fallen out of the policy with it.

        A window past the kept ones, so a restarted traind also catches up on a few it missed.
        """
        return range(max(0, latest - max(self.keep_last, self.keep_states) - 10), latest)

    def _kept_forever(self, version: int) -> bool:
        return self.keep_every > 0 and version > 0 and version % self.keep_every == 0

    def describe(self) -> str:
        """The policy in words, for error messages."""
        every = f", and every {self.keep_every}th version" if self.keep_every else ""
        return f"the job keeps the last {self.keep_last} versions{every} (checkpoint.keep_last/keep_every)"


TrackerKind = Literal["jsonl", "tensorboard", "wandb", "mlflow"]
#: The Python package each tracker needs beyond FlexMARL's own (imported only when the job uses it).
TRACKER_PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class TrackingSpec(_SpecModel):
    """Experiment trackers orchestratord writes each committed step to (docs/tracking.md).

    Every tracker writes under ``<dir>/<job id>/``, on orchestratord's host, with one namespace
    per agent (``<agent>/reward_mean``, ``<agent>/loss``, ...).
    """

    trackers: list[TrackerKind] = Field(default_factory=list)
    """Where each committed step goes: `jsonl` (metrics.jsonl), `tensorboard` (event files), `wandb` (offline
    run) and/or `mlflow` (a file store); tensorboard, wandb and mlflow need their package on orchestratord's host."""
    dir: Annotated[str, Field(min_length=1)] = "runs/tracking"
    """Directory of the job's tracker output on orchestratord's host; relative to orchestratord's working directory
    (the directory `flexmarl up` ran in)."""
    samples: Annotated[int, Field(ge=0, le=1024)] = 0
    """Decoded episodes (prompt and response text per turn, with rewards) each agent's committed step dumps to its
    trackers (samples.jsonl, tensorboard text, a wandb table, mlflow artifacts); 0 dumps none."""
    project: str = ""
    """The wandb project or mlflow experiment the job's run goes to; empty: the job's name."""

    @field_validator("trackers")
    @classmethod
    def _no_duplicates(cls, value: list[str]) -> list[str]:
        duplicates = sorted({kind for kind in value if value.count(kind) > 1})
        if duplicates:
            raise ValueError(f"each tracker at most once, got {duplicates} twice")
        return value


EvalSampling = Literal["greedy", "policy"]
#: The most episodes per held-out task (``evaluation.samples_per_task``, an on-demand round's ``samples_per_task``).
MAX_EVAL_SAMPLES_PER_TASK = 1024
#: The namespace of the team's evaluation figures beside each agent's (trackers, plots): no agent may take it.
TEAM = "team"


class EvaluationSpec(_SpecModel):
    """Held-out evaluation beside training (docs/evaluation.md).

    A round plays `tasks` held-out tasks (`Environment.eval_task`, never a training task), `samples_per_task`
    episodes each, on the agents' current versions, when the team's version (the lowest over the agents) reaches a
    multiple of `every_versions`, and at the final version. Its episodes are never trained on. Rounds run beside
    training: an eval task is leased when the job has no training task to hand out, or as the only eval task in
    flight (at most one while training tasks wait). A job with `evaluation` ends when its final round is recorded.
    """

    every_versions: Annotated[int, Field(ge=1, le=MAX_TOTAL_STEPS)] = 1
    """A round each time the team's version reaches a multiple of this (and at the final version)."""
    tasks: Annotated[int, Field(ge=1, le=100_000)] = 16
    """Held-out tasks per round: `eval_task(0..tasks-1)`, the same tasks every round."""
    samples_per_task: Annotated[int, Field(ge=1, le=MAX_EVAL_SAMPLES_PER_TASK)] = 1
    """Episodes per held-out task; pass@k is over these k samples."""
    sampling: EvalSampling = "greedy"
    """`greedy` (temperature 0 for every turn, whatever the episode asks) or `policy` (the agents' own sampling)."""
    before_training: bool = False
    """Also evaluate version 0 (after any warm start), before the first optimizer step: the starting point."""
    success_threshold: float = 1.0
    """An agent's episode counts as a success when its return is >= this; the team's when the environment's
    `ctx.notes["success"]` is true, or without that note when every agent's is."""


class JobSpec(_SpecModel):
    """A whole FlexMARL job."""

    name: Annotated[str, Field(pattern=JOB_NAME_PATTERN)]
    """The job's name; the job id is derived from it."""
    seed: Annotated[int, Field(ge=0, lt=2**63)] = 0
    """Seeds the task stream, sampling and training."""
    environment: EnvironmentSpec
    """What the agents play."""
    agents: Annotated[list[AgentSpec], Field(min_length=1, max_length=MAX_AGENTS)]
    """The trained agents, each its own policy."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """The RL algorithm and its loss options."""
    batch: BatchSpec
    """Sizes of one step."""
    total_steps: Annotated[int, Field(ge=1, le=MAX_TOTAL_STEPS)]
    """Optimizer steps per agent; the job succeeds when every agent reached them."""
    pipeline: PipelineSpec = Field(default_factory=PipelineSpec)
    """Pipeline mode, staleness bound and slot binding."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """How rolloutd balances generations over engine replicas."""
    leases: LeaseSpec = Field(default_factory=LeaseSpec)
    """Lease timeouts of rollout tasks and trainer work."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """What traind keeps of each agent's versions."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """Experiment trackers and sample dumps written each committed step."""
    evaluation: EvaluationSpec | None = None
    """Held-out evaluation rounds beside training (docs/evaluation.md); unset: none."""

    @model_validator(mode="after")
    def _cross_field_rules(self) -> JobSpec:
        problems = _cross_field_problems(self)
        if problems:
            # One error whose lines already carry their own field paths.
            raise PydanticCustomError("job_spec", "\n".join(problems))
        return self

    @property
    def agent_names(self) -> tuple[str, ...]:
        """Agent names in spec order."""
        return tuple(agent.name for agent in self.agents)

    @property
    def rollout_tasks_ahead(self) -> int:
        """Rollout tasks the staleness rule admits beyond the lowest committed version's steps.

        ``(eta + 1) x prompts_per_step`` (AReaL's rule, eta 0 under a barrier): the most tasks that can be
        in flight at once, and so the ``rolloutd --max-tasks`` the job needs for its eta to take effect (a
        rolloutd that runs fewer keeps fewer steps of tasks in flight than eta allows); ``--max-tasks auto``
        sums it over the served jobs and shares it among the live rolloutds (``rolloutd/task_limit.py``).
        """
        eta = 0 if self.pipeline.barrier else self.pipeline.max_staleness
        return (eta + 1) * self.batch.prompts_per_step

    @property
    def balancing(self) -> BalancingPolicy:
        """The balancing policy of rolloutd, after the mode's default is applied."""
        if self.rollout.balancing is not None:
            return self.rollout.balancing
        return "static" if self.pipeline.mode == "static" else "hierarchical"

    def agent(self, name: str) -> AgentSpec:
        """The spec of one agent; raises InvalidArgument for an unknown name."""
        for agent in self.agents:
            if agent.name == name:
                return agent
        raise InvalidArgument(f"agents: no agent named {name!r}")

    def algorithm_of(self, name: str) -> AlgorithmSpec:
        """The `algorithm` one agent trains with: the job's, with the agent's own `algorithm` fields on top."""
        overrides = self.agent(name).algorithm.model_dump(exclude_none=True)
        return self.algorithm.model_copy(update=overrides) if overrides else self.algorithm

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, defaults filled in): what the SDK sends and orchestratord stores."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """:func:`spec_digest` of :meth:`to_json`: how rollout tasks and trainer work name the spec."""
        return spec_digest(self.to_json())


def spec_digest(spec_json: str) -> str:
    """sha256 (hex) of a spec's canonical JSON text."""
    return hashlib.sha256(spec_json.encode()).hexdigest()


#: The rules :func:`_cross_field_problems` checks, in words (docs/jobspec.md lists them).
CROSS_FIELD_RULES = (
    "`batch.group_size` >= 2 when `algorithm.name` is `grpo` (a group needs a baseline).",
    "`batch.micro_batch_size` is a multiple of `batch.group_size` (micro-batches hold whole groups).",
    "`batch.micro_batch_size` <= `batch.prompts_per_step` * `batch.group_size`.",
    "`pipeline.mode: static` fixes slots and replicas: `pipeline.binding: dynamic` and "
    "`rollout.balancing: hierarchical` contradict it.",
    "Agent names are unique.",
    "`rollout.partial_rollout` needs `pipeline.mode: async` and `pipeline.max_staleness` >= 1 "
    "(strict and barrier modes never interrupt a generation).",
    "`rollout.mask_stale_tokens` needs `rollout.partial_rollout`.",
    "`pipeline.step_fill: completion` needs `pipeline.mode: async` and `pipeline.max_staleness` >= 1 (strict and "
    "barrier modes train step t on batch t).",
    "An agent with a `warm_start` has `max_slots: 1` and a KL coefficient of 0 (the KL reference would be the "
    "checkpoint before the warm start).",
    "A LoRA agent (`lora`) has `zero_stage: 0` and `max_slots: 1` (it trains on one slot, where ZeRO partitions "
    "nothing but a ZeRO 3 engine would partition the shared base).",
    "LoRA agents with the same base (`model`) have the same `dtype` (they share one copy of it). A base may also "
    "be a full-model agent's `model`: that agent trains its own copy.",
    "A LoRA agent needs `rollout.weight_sync: disk` (its versions are adapter directories, not whole models).",
    "`evaluation.samples_per_task` > 1 needs `evaluation.sampling: policy` (greedy samples are all the same).",
    "With `evaluation`, no agent is named `team` (the team's evaluation figures go under that name).",
)


def _cross_field_problems(spec: JobSpec) -> list[str]:
    problems: list[str] = []
    batch = spec.batch
    if spec.algorithm.name == "grpo" and batch.group_size < 2:
        problems.append(f"batch.group_size: must be >= 2 for algorithm grpo (a group needs a baseline), "
                        f"got {batch.group_size}")
    if batch.micro_batch_size % batch.group_size:
        problems.append(f"batch.micro_batch_size: must be a multiple of batch.group_size ({batch.group_size}), "
                        f"got {batch.micro_batch_size}")
    if batch.micro_batch_size > batch.episodes_per_step:
        problems.append(f"batch.micro_batch_size: must be <= batch.prompts_per_step * batch.group_size "
                        f"({batch.episodes_per_step}), got {batch.micro_batch_size}")
    pipeline = spec.pipeline
    if pipeline.mode == "static" and pipeline.binding == "dynamic":
        problems.append("pipeline.binding: mode 'static' fixes each agent's slots; 'dynamic' contradicts it")
    if pipeline.mode == "static" and spec.rollout.balancing == "hierarchical":
        problems.append("rollout.balancing: mode 'static' fixes each agent's replicas; 'hierarchical' contradicts it")
    if spec.rollout.partial_rollout and (pipeline.barrier or pipeline.max_staleness == 0):
        problems.append(f"rollout.partial_rollout: needs pipeline.mode async and pipeline.max_staleness >= 1 "
                        f"(mode {pipeline.mode!r}, max_staleness {pipeline.max_staleness} never interrupts)")
    if spec.rollout.mask_stale_tokens and not spec.rollout.partial_rollout:
        problems.append("rollout.mask_stale_tokens: needs rollout.partial_rollout")
    if pipeline.fills_by_completion and (pipeline.barrier or pipeline.max_staleness == 0):
        problems.append(f"pipeline.step_fill: 'completion' needs pipeline.mode async and pipeline.max_staleness >= 1 "
                        f"(mode {pipeline.mode!r}, max_staleness {pipeline.max_staleness} trains step t on batch t)")
    seen: dict[str, int] = {}
    for index, agent in enumerate(spec.agents):
        if agent.name in seen:
            problems.append(f"agents[{index}].name: duplicate agent name {agent.name!r} "
                            f"(also agents[{seen[agent.name]}])")
        else:
            seen[agent.name] = index
    evaluation = spec.evaluation
    if evaluation is not None and evaluation.sampling == "greedy" and evaluation.samples_per_task > 1:
        problems.append(f"evaluation.samples_per_task: greedy sampling draws the same episode "
                        f"{evaluation.samples_per_task} times; use sampling: policy for pass@k over several samples")
    if evaluation is not None and TEAM in seen:
        problems.append(f"agents[{seen[TEAM]}].name: {TEAM!r} names the team's evaluation figures; rename the agent")
    problems += _warm_start_problems(spec)
    problems += _lora_problems(spec)
    return problems


def _lora_problems(spec: JobSpec) -> list[str]:
    problems: list[str] = []
    first_of_base: dict[str, int] = {}
    for index, agent in enumerate(spec.agents):
        if agent.lora is None:
            continue
        if agent.zero_stage != 0:
            problems.append(f"agents[{index}].zero_stage: a LoRA agent trains with ZeRO 0 (on one slot ZeRO "
                            f"partitions nothing; ZeRO 3 would partition the shared base), got {agent.zero_stage}")
        if agent.max_slots != 1:
            problems.append(f"agents[{index}].max_slots: a LoRA agent trains on one slot (data-parallel adapter "
                            f"agents are not built), got {agent.max_slots}")
        if spec.rollout.weight_sync == "distributed":
            problems.append(f"agents[{index}].lora: a LoRA agent's versions are adapter directories the engines "
                            f"load (/load_lora_adapter); rollout.weight_sync 'distributed' broadcasts whole models")
        first = first_of_base.setdefault(agent.model, index)
        if spec.agents[first].dtype != agent.dtype:
            problems.append(f"agents[{index}].dtype: LoRA agents over base {agent.model!r} share it, so they need "
                            f"one dtype: agents[{first}] has {spec.agents[first].dtype!r}, got {agent.dtype!r}")
    return problems


def _warm_start_problems(spec: JobSpec) -> list[str]:
    problems: list[str] = []
    for index, agent in enumerate(spec.agents):
        if agent.warm_start is None:
            continue
        if agent.max_slots != 1:
            problems.append(f"agents[{index}].warm_start: needs max_slots 1 (a warm start runs in one slot), "
                            f"got max_slots {agent.max_slots}")
        kl_coef = agent.algorithm.kl_coef if agent.algorithm.kl_coef is not None else spec.algorithm.kl_coef
        if kl_coef > 0.0:
            problems.append(f"agents[{index}].warm_start: needs a KL coefficient of 0 (the KL reference would be "
                            f"the checkpoint before the warm start), got {kl_coef}")
    return problems


def parse_job_spec(data: Any) -> JobSpec:
    """Validates a decoded spec (a mapping); raises InvalidArgument with one line per problem."""
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"job spec: must be a mapping, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(dict(data))
    except ValidationError as error:
        raise InvalidArgument("\n".join(format_errors(error, skip=(ONE, MANY)))) from None


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3`` as a float (YAML 1.2) rather than a string (YAML 1.1)."""


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _is_file(text: str) -> bool:
    """True when text names an existing file; a spec longer than a file name is not one (ENAMETOOLONG)."""
    try:
        return Path(text).is_file()
    except OSError:
        return False


def resolve_dataset_paths(data: Any, base_dir: Path) -> Any:
    """A decoded spec with ``environment.dataset``'s relative file paths made absolute against ``base_dir``.

    A job file's dataset paths are relative to the file (``base_dir``: its directory); anything
    that is not a decoded spec with such paths is returned unchanged, for validation to judge.
    """
    if not isinstance(data, Mapping):
        return data
    environment = data.get("environment")
    dataset = environment.get("dataset") if isinstance(environment, Mapping) else None
    if not isinstance(environment, Mapping) or not isinstance(dataset, Mapping):
        return data

    def absolute(value: Any) -> Any:
        if isinstance(value, str) and value:
            return os.path.abspath(base_dir / value)
        if isinstance(value, list):
            return [absolute(item) for item in value]
        return value

    resolved = {key: absolute(value) if key in ("train", "eval") else value for key, value in dataset.items()}
    return {**data, "environment": {**environment, "dataset": resolved}}


def load_job_spec(text_or_path: str | Path) -> JobSpec:
    """Loads a job spec from YAML/JSON text or from a file path.

    A :class:`~pathlib.Path`, or a string without a newline that names an
    existing file, is read as a file; anything else is parsed as text. JSON is
    a subset of YAML, so one parser handles both. Relative ``environment.dataset``
    paths are made absolute against the file's directory (text: the current one).

    Raises:
        InvalidArgument: the text does not parse or the spec is invalid.
    """
    text: str
    base_dir = Path.cwd()
    if isinstance(text_or_path, Path) or ("\n" not in text_or_path and _is_file(text_or_path)):
        path = Path(text_or_path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise InvalidArgument(f"job spec: cannot read {str(path)!r}: {error.strerror}") from None
        base_dir = path.parent
    else:
        text = text_or_path
    try:
        data = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise InvalidArgument(f"job spec: not valid YAML/JSON: {error}".replace("\n", " ")) from None
    return parse_job_spec(resolve_dataset_paths(data, base_dir))


class JobSpecCache:
    """Job specs by job id for a worker: fetched once per job, checked against the digest work names.

    Rollout tasks and trainer work carry only the spec's digest (a spec may be up to 1 MiB); the first
    piece of work of a job fetches the spec (orchestratord's GetJob), and every later one reuses it
    while its digest matches. A job's spec never changes, so a mismatch means the fetch raced a
    resubmission under the same id, and is an error rather than a silent mix of two specs.
    """

    def __init__(self, fetch: Callable[[str], Awaitable[str]]) -> None:
        """fetch(job_id) returns the job's spec JSON (JobStatus.spec_json)."""
        self._fetch = fetch
        self._specs: dict[str, tuple[str, JobSpec]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def cached_spec(self, job_id: str) -> JobSpec | None:
        """The spec of job_id fetched so far, whatever its digest (None before the first fetch)."""
        entry = self._specs.get(job_id)
        return entry[1] if entry is not None else None

    def cached(self, job_id: str, digest: str) -> JobSpec | None:
        """The cached spec of job_id if its digest is ``digest``, else None."""
        entry = self._specs.get(job_id)
        return entry[1] if entry is not None and entry[0] == digest else None

    async def get(self, job_id: str, digest: str) -> JobSpec:
        """The spec of job_id whose digest is ``digest``, fetched at most once per job.

        Raises:
            InvalidArgument: ``digest`` is empty, or the fetched spec does not parse.
            FailedPrecondition: the fetched spec has another digest.
        """
        if not digest:
            raise InvalidArgument(f"job {job_id}: work names no spec digest")
        spec = self.cached(job_id, digest)
        if spec is not None:
            return spec
        lock = self._locks.setdefault(job_id, asyncio.Lock())
        async with lock:  # one fetch per job, however many of its pieces of work arrive at once
            spec = self.cached(job_id, digest)
            if spec is not None:
                return spec
            spec_json = await self._fetch(job_id)
            fetched = spec_digest(spec_json)
            if fetched != digest:
                raise FailedPrecondition(
                    f"job {job_id}: its spec has digest {fetched[:12]}, the work names {digest[:12]}")
            try:
                data = json.loads(spec_json)  # JSON text from orchestratord, never a path on this host
            except ValueError as exc:
                raise InvalidArgument(f"job {job_id}: spec is not valid JSON: {exc}") from None
            spec = parse_job_spec(data)
            self._specs[job_id] = (digest, spec)
            return spec

    def forget(self, job_id: str) -> None:
        """Drops a job's spec (the job is gone from this worker)."""
        self._specs.pop(job_id, None)
        self._locks.pop(job_id, None)
