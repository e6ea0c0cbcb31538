"""LoRA adapters served over one base model, as SGLang 0.5.23 serves them.

Three parts, each mirroring SGLang's split between its processes:

* :class:`LoraSettings`: the server flags (sglang/srt/arg_groups/fields/lora.py: ``--enable-lora``,
  ``--max-lora-rank``, ``--lora-target-modules``, ``--lora-paths``, ``--max-loras-per-batch``,
  ``--max-loaded-loras``) and their start-up checks (sglang/srt/arg_groups/lora_hook.py
  ``check_lora_server_args``; sglang/srt/arg_groups/argparse_actions.py ``LoRAPathAction``).
* :class:`LoraRegistry`: the tokenizer manager's view (sglang/srt/lora/lora_registry.py, and the
  load/unload flow of sglang/srt/managers/tokenizer_control_mixin.py and ``_resolve_lora_path`` of
  tokenizer_manager.py): adapter names in LRU order, a usage counter per adapter id, unloads that
  wait for the requests using an adapter, implicit reloads of an unloaded adapter a request names.
* :class:`AdapterPool` (and, for a real model, :class:`LoraLayers`): the scheduler's view
  (sglang/srt/lora/lora_manager.py ``validate_new_adapter``, ``validate_lora_batch``;
  sglang/srt/lora/mem_pool.py ``can_support``; sglang/srt/lora/lora_config.py ``LoRAConfig``).

The adapter format is PEFT's directory (``adapter_config.json`` + ``adapter_model.safetensors``,
as ``PeftModel.save_pretrained`` writes it; tensor keys ``base_model.model.<module>.lora_A.weight``
and ``.lora_B.weight``), read with json and safetensors only (rolloutd never imports peft).
The delta of a target ``Linear`` is PEFT's ``lora_B(lora_A(x)) * lora_alpha / r`` (no dropout at
inference; SGLang's ``LoRAAdapter.scaling`` in sglang/srt/lora/lora.py is ``lora_alpha / r`` too),
applied per row, so one forward pass serves rows of different adapters and the base together.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from flexmarl.errors import InvalidArgument

logger = logging.getLogger(__name__)

#: sglang/srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES (the choices of --lora-target-modules).
SUPPORTED_LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_b_proj",
    "kv_b_proj",
    "wq_b",
    "wk",
    "weights_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "embed_tokens",
    "lm_head",
    "qkvr",
    "wo_ud",
)
LORA_TARGET_ALL_MODULES = "all"
#: sglang/srt/lora/utils.py EMBEDDING_NAMES (added to the targets of ``--lora-target-modules all``).
EMBEDDING_NAMES = frozenset({"embed_tokens", "lm_head"})
#: sglang/srt/lora/utils.py ``get_normalized_target_modules``: PEFT module names -> SGLang's fused weights.
_NORMALIZED_NAMES: dict[str, str] = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "out_proj": "out_proj",
    "embed_tokens": "embed_tokens",
    "vocab_emb": "embed_tokens",
    "embeddings": "embed_tokens",
    "word_embeddings": "embed_tokens",
    "lm_head": "lm_head",
    "output": "lm_head",
    "unembed_tokens": "lm_head",
    "q_a_proj": "fused_qkv_a_proj_with_mqa",
    "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
    "wq_b": "indexer.wq_b",
    "wk": "indexer.wk",
    "weights_proj": "indexer.weights_proj",
}
#: fields/lora.py default of --max-loras-per-batch.
DEFAULT_MAX_LORAS_PER_BATCH = 8
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
NOT_ENABLED_MESSAGE = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


def normalized_target_modules(target_modules: str | Iterable[str]) -> set[str]:
    """sglang/srt/lora/utils.py ``get_normalized_target_modules`` (``{"all"}`` for PEFT's shorthands).

    Raises:
        ValueError: A string other than ``"all"`` / ``"all-linear"`` (SGLang's message).
    """
    if isinstance(target_modules, str):
        if target_modules not in ("all", "all-linear"):
            raise ValueError("Only 'all' or 'all-linear' can be used as the string for target module")
        return {"all"}
    return {_NORMALIZED_NAMES.get(name.split(".")[-1], name.split(".")[-1]) for name in target_modules}


def _odict_keys(names: Iterable[str]) -> str:
    """How Python prints an OrderedDict's keys, as SGLang's registry messages show them."""
    return f"odict_keys({list(names)!r})"


def _dict_keys(names: Iterable[str]) -> str:
    return f"dict_keys({list(names)!r})"


# ----- references and settings -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoraRef:
    """lora_registry.py ``LoRARef``: one load of an adapter (a fresh id per load)."""

    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False

    @staticmethod
    def deterministic_id(lora_name: str, lora_path: str) -> str:
        """The id of a ``--lora-paths`` adapter (``uuid5`` of name and path, as SGLang)."""
        return uuid.uuid5(uuid.NAMESPACE_URL, f"{lora_name}\0{lora_path}").hex

    @classmethod
    def new(cls, lora_name: str, lora_path: str, pinned: bool) -> LoraRef:
        """A fresh load (``uuid4`` id, as the tokenizer manager mints one per /load_lora_adapter)."""
        return cls(uuid.uuid4().hex, lora_name, lora_path, pinned)


def parse_lora_path(value: str) -> LoraRef:
    """One ``--lora-paths`` entry: ``<PATH>``, ``<NAME>=<PATH>`` or ``{"lora_name", "lora_path", "pinned"}``.

    argparse_actions.py ``LoRAPathAction`` then lora_hook.py ``check_lora_server_args``.

    Raises:
        InvalidArgument: A JSON entry without ``lora_name`` and ``lora_path``.
    """
    text = value.strip()
    if text.startswith("{") and text.endswith("}"):
        obj = json.loads(text)
        if not (isinstance(obj, dict) and "lora_path" in obj and "lora_name" in obj):
            raise InvalidArgument(
                f"{text!r} looks like a JSON str, but it does not contain 'lora_name' and 'lora_path' keys."
            )
        name, path = str(obj["lora_name"]), str(obj["lora_path"])
        return LoraRef(LoraRef.deterministic_id(name, path), name, path, bool(obj.get("pinned", False)))
    if "=" in text:
        name, path = text.split("=", 1)
        return LoraRef(LoraRef.deterministic_id(name, path), name, path)
    return LoraRef(LoraRef.deterministic_id(text, text), text, text)


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """The LoRA flags of one server (fields/lora.py names; None = not given)."""

    enable_lora: bool | None = None
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] | None = None
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int = DEFAULT_MAX_LORAS_PER_BATCH
    max_loaded_loras: int | None = None

    @property
    def enabled(self) -> bool:
        """``--enable-lora``, or ``--lora-paths`` without ``--enable-lora`` given (lora_hook.py)."""
        return bool(self.enable_lora) or (self.enable_lora is None and bool(self.lora_paths))

    def initial_refs(self) -> list[LoraRef]:
        """The ``--lora-paths`` adapters, with their deterministic ids (none unless enabled)."""
        return [parse_lora_path(value) for value in self.lora_paths] if self.enabled else []

    def check(self) -> None:
        """lora_hook.py ``check_lora_server_args``: SGLang's start-up assertions, with their messages.

        Raises:
            InvalidArgument: A combination SGLang refuses to start with.
        """
        if self.max_loras_per_batch <= 0:
            raise InvalidArgument("max_loras_per_batch must be positive")
        if not self.enabled:
            return
        targets = self.lora_target_modules
        if targets:
            choices = (*SUPPORTED_LORA_TARGET_MODULES, LORA_TARGET_ALL_MODULES)
            unknown = [name for name in targets if name not in choices]
            if unknown:
                raise InvalidArgument(f"--lora-target-modules: invalid choice: {unknown[0]!r}")
            if LORA_TARGET_ALL_MODULES in targets and len(set(targets)) != 1:
                raise InvalidArgument(
                    "If 'all' is specified in --lora-target-modules, it should be the only module specified."
                )
        refs = self.initial_refs()
        if not (refs or (self.max_lora_rank and targets)):
            raise InvalidArgument(
                "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
                "--lora-target-modules for LoRA initialization."
            )
        if self.max_loaded_loras is not None:
            if self.max_loaded_loras < self.max_loras_per_batch:
                raise InvalidArgument(
                    "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                    f"max_loaded_loras={self.max_loaded_loras}, max_loras_per_batch={self.max_loras_per_batch}"
                )
            if len(refs) > self.max_loaded_loras:
                raise InvalidArgument(
                    "The number of LoRA paths should not exceed max_loaded_loras. "
                    f"max_loaded_loras={self.max_loaded_loras}, lora_paths={len(refs)}"
                )

    def cli_args(self) -> list[str]:
        """These settings as SGLang's (and the embedded engine's) command-line flags."""
        args: list[str] = []
        if self.enable_lora:
            args.append("--enable-lora")
        if self.max_lora_rank is not None:
            args += ["--max-lora-rank", str(self.max_lora_rank)]
        if self.lora_target_modules:
            args += ["--lora-target-modules", *self.lora_target_modules]
        if self.lora_paths:
            args += ["--lora-paths", *self.lora_paths]
        if self.max_loras_per_batch != DEFAULT_MAX_LORAS_PER_BATCH:
            args += ["--max-loras-per-batch", str(self.max_loras_per_batch)]
        if self.max_loaded_loras is not None:
            args += ["--max-loaded-loras", str(self.max_loaded_loras)]
        return args


def add_lora_arguments(parser: Any) -> None:
    """The LoRA flags of fields/lora.py on an ``argparse`` parser (shared by the shipped engines)."""
    parser.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank served")
    parser.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=None,
        choices=[*SUPPORTED_LORA_TARGET_MODULES, LORA_TARGET_ALL_MODULES],
        help="modules adapters may target ('all': every supported one)",
    )
    parser.add_argument(
        "--lora-paths", nargs="*", default=None, help='adapters loaded at start: <PATH> | <NAME>=<PATH> | JSON'
    )
    parser.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=DEFAULT_MAX_LORAS_PER_BATCH,
        help="most distinct adapters (the base included) in one running batch",
    )
    parser.add_argument(
        "--max-loaded-loras", type=int, default=None, help="most adapters loaded at once (LRU eviction beyond)"
    )


def settings_from_args(args: Any) -> LoraSettings:
    """The :class:`LoraSettings` of parsed :func:`add_lora_arguments` flags."""
    return LoraSettings(
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=tuple(args.lora_target_modules) if args.lora_target_modules else None,
        lora_paths=tuple(args.lora_paths or ()),
        max_loras_per_batch=args.max_loras_per_batch,
        max_loaded_loras=args.max_loaded_loras,
    )


# ----- adapter files (lora_config.py) -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """lora_config.py ``LoRAConfig``: what the scheduler checks before it loads the weights."""

    path: str
    target_modules: Any  # PEFT's list of module names, or a shorthand string
    r: int
    lora_alpha: float
    use_dora: bool
    added_tokens: int

    @property
    def scaling(self) -> float:
        """lora.py ``LoRAAdapter.scaling``: ``lora_alpha / r``."""
        return self.lora_alpha / self.r


def read_adapter_config(path: str, base_vocab_size: int) -> AdapterConfig:
    """Read ``adapter_config.json`` (and ``added_tokens.json``) of a local PEFT adapter directory.

    SGLang downloads a non-directory path from the Hugging Face hub; rolloutd's engines serve
    local directories only, so such a path fails as SGLang's download fails offline.

    Raises:
        ValueError: Not a directory, no or unreadable config (the message SGLang's load reports).
    """
    if not os.path.isdir(path):
        raise ValueError(
            f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. "
            "Use `repo_type` argument if needed."
        )
    config_path = os.path.join(path, ADAPTER_CONFIG_FILE)
    try:
        with open(config_path, encoding="utf-8") as file:
            hf_config = json.load(file)
    except FileNotFoundError as exc:
        raise ValueError(f"[Errno 2] No such file or directory: '{config_path}'") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(str(exc)) from exc
    try:
        target_modules, r, alpha = hf_config["target_modules"], int(hf_config["r"]), float(hf_config["lora_alpha"])
    except KeyError as exc:
        raise ValueError(repr(exc.args[0])) from exc
    added = 0
    added_path = os.path.join(path, "added_tokens.json")
    if os.path.exists(added_path):
        try:
            with open(added_path, encoding="utf-8") as file:
                tokens = json.load(file)
            added = sum(1 for token_id in tokens.values() if int(token_id) >= base_vocab_size)
        except (json.JSONDecodeError, AttributeError, ValueError):
            logger.warning("Failed to parse added_tokens.json of %s", path)
    return AdapterConfig(path, target_modules, r, alpha, bool(hf_config.get("use_dora", False)), added)


def adapter_weights_path(path: str) -> Path:
    """The safetensors file of an adapter directory."""
    return Path(path) / ADAPTER_WEIGHTS_FILE


def adapter_num_params(path: str) -> int:
    """Parameters in an adapter's safetensors file, read from its header (no tensor data)."""
    file = adapter_weights_path(path)
    with open(file, "rb") as handle:
        header_size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_size))
    count = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        size = 1
        for dim in entry["shape"]:
            size *= int(dim)
        count += size
    return count


# ----- the scheduler's adapter table (lora_manager.py) ----------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoraUpdate:
    """io_struct.py ``LoRAUpdateOutput``: the answer of /load_lora_adapter and /unload_lora_adapter."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        """``msgspec_to_builtins`` of the struct: the ``BaseReq`` fields first, then its own."""
        return {
            "rid": None,
            "http_worker_ipc": None,
            "success": self.success,
            "error_message": self.error_message,
            "loaded_adapters": self.loaded_adapters,
        }


class AdapterPool:
    """The adapters a scheduler holds, and what may load and share a batch (lora_manager.py).

    ``target_modules`` is the resolved ``--lora-target-modules`` (normalized names; for ``all``,
    what the model has), ``max_rank`` the resolved ``--max-lora-rank``.
    """

    def __init__(self, settings: LoraSettings, target_modules: set[str], max_rank: int) -> None:
        self.settings = settings
        self.target_modules = frozenset(target_modules)
        self.max_rank = max_rank
        self.refs: dict[str, LoraRef] = {}  # lora_id -> ref, in load order
        self.configs: dict[str, AdapterConfig] = {}
        self.num_pinned = 0

    @staticmethod
    def resolve_shapes(
        settings: LoraSettings, configs: Sequence[tuple[str, AdapterConfig]], model_modules: set[str] | None
    ) -> tuple[set[str], int]:
        """lora_manager.py ``init_lora_shapes``: the target modules and max rank, from flags or adapters.

        ``model_modules`` are the normalized names of the model's supported modules (None: no
        model, as in the synthetic engine, where ``all`` admits every name).

        Raises:
            ValueError: An initial adapter targets a module the flags exclude (SGLang's message).
        """
        given = settings.lora_target_modules
        if given and set(given) == {LORA_TARGET_ALL_MODULES}:
            targets = set(model_modules) | set(EMBEDDING_NAMES) if model_modules is not None else {"all"}
        elif given:
            targets = normalized_target_modules(given)
        else:
            targets = set()
        for name, config in configs:
            adapter_targets = normalized_target_modules(config.target_modules)
            if "all" in adapter_targets:
                if given is None:
                    targets |= set(model_modules) if model_modules is not None else {"all"}
                continue
            if given:
                if not adapter_targets <= targets and "all" not in targets:
                    unsupported = adapter_targets - targets
                    raise ValueError(
                        f"LoRA adapter '{name}' contains target modules {sorted(unsupported)} that are not included "
                        f"in the specified --lora-target-modules {sorted(targets)}. Please update "
                        "--lora-target-modules to include all required modules: "
                        f"{sorted(targets | adapter_targets)}, or use 'all' to enable all supported modules."
                    )
            else:
                targets |= adapter_targets
        max_rank = settings.max_lora_rank
        if max_rank is None:
            max_rank = max((config.r for _, config in configs), default=0)
        return targets, max_rank

    def can_support(self, config: AdapterConfig) -> bool:
        """mem_pool.py ``can_support``: rank within the max, targets within the served targets."""
        if config.r > self.max_rank or config.added_tokens > 0:
            return False
        names = normalized_target_modules(config.target_modules)
        return "all" in names or "all" in self.target_modules or names <= self.target_modules

    def validate_new(self, config: AdapterConfig, ref: LoraRef) -> None:
        """lora_manager.py ``validate_new_adapter``, in its order, with its messages.

        Raises:
            ValueError: The adapter cannot be loaded.
        """
        if config.added_tokens > 0:
            raise ValueError(
                f"Failed to load {ref.lora_name} because LoRA serving currently doesn't support adapters that "
                "add tokens to the vocabulary"
            )
        if config.use_dora:
            raise ValueError(
                f"Failed to load {ref.lora_name} because LoRA serving currently doesn't support DoRA adapters"
            )
        for existing in self.refs.values():
            if existing.lora_name == ref.lora_name:
                raise ValueError(f"Failed to load LoRA adapter {ref.lora_name} because it is already loaded")
            if existing.lora_path == ref.lora_path:
                logger.warning(
                    "%s is already loaded with name: %s, but another copy is being loaded with name: %s",
                    ref.lora_path, existing.lora_name, ref.lora_name,
                )
        if not self.can_support(config):
            raise ValueError(
                f"LoRA adapter {ref.lora_name} with rank {config.r} is incompatible with the current LoRA memory "
                "pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
            )
        if ref.pinned and self.num_pinned >= self.settings.max_loras_per_batch - 1:
            raise ValueError(
                f"Failed to load LoRA adapter {ref.lora_name} as a pinned adapter. It is not allowed to pin all "
                "slots in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please "
                "increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters."
            )

    def add(self, ref: LoraRef, config: AdapterConfig) -> None:
        """Record a loaded adapter."""
        self.refs[ref.lora_id] = ref
        self.configs[ref.lora_id] = config
        self.num_pinned += int(ref.pinned)

    def remove(self, lora_id: str) -> None:
        """Forget an adapter (a no-op for an unknown id, as lora_manager.py ``_unload_lora_adapter``)."""
        ref = self.refs.pop(lora_id, None)
        self.configs.pop(lora_id, None)
        if ref is not None:
            self.num_pinned -= int(ref.pinned)

    def result(self, success: bool, error_message: str = "") -> LoraUpdate:
        """lora_manager.py ``create_lora_update_result``."""
        loaded = {ref.lora_name: ref.lora_path for ref in self.refs.values()}
        return LoraUpdate(success, error_message, loaded)

    def validate_batch(self, lora_ids: set[str | None]) -> bool:
        """lora_manager.py ``validate_lora_batch``: the distinct adapters (base included) fit a batch."""
        limit = self.settings.max_loras_per_batch
        if len(lora_ids) > limit:
            return False
        if self.num_pinned == 0:
            return True
        pinned = sum(1 for lora_id in lora_ids if lora_id is not None and self.refs[lora_id].pinned)
        return len(lora_ids) - pinned <= limit - self.num_pinned

    def can_schedule(self, lora_id: str | None, running: set[str | None]) -> bool:
        """scheduler.py ``can_schedule_lora_req``: already in the batch, or the batch with it validates."""
        return lora_id in running or self.validate_batch(running | {lora_id})


def can_schedule(pool: AdapterPool | None, lora_id: str | None, running: set[str | None]) -> bool:
    """Whether a request of ``lora_id`` may join a batch of ``running`` adapters (always, without LoRA)."""
    return pool is None or pool.can_schedule(lora_id, running)


# ----- the tokenizer manager's registry (lora_registry.py, tokenizer_control_mixin.py) -------------------
class LoraRegistry:
    """Names of loaded adapters (LRU order), usage counters, and the name -> ref cache of every load.

    Runs on the server's event loop. Load and unload hold one lock (``lora_update_lock``);
    :meth:`acquire` counts a request on its adapters and :meth:`release` uncounts it.
    """

    def __init__(self, settings: LoraSettings) -> None:
        self.settings = settings
        self.lock = asyncio.Lock()
        self._registry: collections.OrderedDict[str, LoraRef] = collections.OrderedDict()
        self._counters: dict[str, int] = {}
        self._zero = asyncio.Condition()
        self._notifications: set[asyncio.Task[None]] = set()
        self.ref_cache: dict[str, LoraRef] = {}  # every name ever loaded -> its last ref
        self.pending_unloads: dict[str, str] = {}  # name -> lora_id unregistered, not yet unloaded
        for ref in settings.initial_refs():
            self._register(ref)
            self.ref_cache[ref.lora_name] = ref

    @property
    def enabled(self) -> bool:
        """Whether the server serves adapters."""
        return self.settings.enabled

    def adapters(self) -> dict[str, LoraRef]:
        """The registered adapters by name, least recently used first."""
        return dict(self._registry)

    def _register(self, ref: LoraRef) -> None:
        if ref.lora_name in self._registry:
            raise ValueError(
                f"LoRA with name {ref.lora_name} already exists. Loaded LoRAs: {_odict_keys(self._registry)}"
            )
        self._registry[ref.lora_name] = ref
        self._counters[ref.lora_id] = 0

    def register(self, ref: LoraRef) -> None:
        """Make ``ref`` available to requests."""
        self._register(ref)
        self.ref_cache[ref.lora_name] = ref

    def unregister(self, lora_name: str) -> str:
        """Stop new requests from using ``lora_name``; returns its id.

        Raises:
            ValueError: No adapter of that name is registered (SGLang's message).
        """
        ref = self._registry.get(lora_name)
        if ref is None:
            raise ValueError(f"LoRA with name {lora_name} does not exist. Loaded LoRAs: {_odict_keys(self._registry)}")
        del self._registry[lora_name]
        return ref.lora_id

    def lru_name(self, *, exclude_pinned: bool) -> str | None:
        """The least recently used adapter (not pinned, with ``exclude_pinned``)."""
        for name, ref in self._registry.items():
            if not (exclude_pinned and ref.pinned):
                return name
        return None

    def unregistered(self, names: Iterable[str | None]) -> list[str | None]:
        """The names that are not registered; a registered one counts as used (``get_unregistered_loras``)."""
        missing: list[str | None] = []
        for name in names:
            if name is not None and name in self._registry:
                self._registry.move_to_end(name)
            else:
                missing.append(name)
        return missing

    def acquire(self, names: Sequence[str | None]) -> list[str | None]:
        """The ids of ``names`` (None: the base), each counted as used by one more request.

        Raises:
            ValueError: A name that is not registered (SGLang's message).
        """
        ids: list[str | None] = []
        for name in names:
            if name is None:
                ids.append(None)
                continue
            ref = self._registry.get(name)
            if ref is None:
                raise ValueError(
                    f"The following requested LoRA adapters are not loaded: {name}\n"
                    f"Loaded adapters: {_odict_keys(self._registry)}."
                )
            self._registry.move_to_end(name)
            ids.append(ref.lora_id)
        for lora_id in ids:
            if lora_id is not None:
                self._counters[lora_id] = self._counters.get(lora_id, 0) + 1
        return ids

    def release(self, lora_id: str | None) -> None:
        """One request no longer uses ``lora_id``."""
        if lora_id is None or lora_id not in self._counters:
            return
        self._counters[lora_id] -= 1
        if self._counters[lora_id] <= 0:
            task = asyncio.get_running_loop().create_task(self._notify())
            self._notifications.add(task)
            task.add_done_callback(self._notifications.discard)

    async def _notify(self) -> None:
        async with self._zero:
            self._zero.notify_all()

    def in_use(self, lora_id: str) -> int:
        """Requests now using ``lora_id``."""
        return self._counters.get(lora_id, 0)

    async def wait_for_unload(self, lora_id: str) -> None:
        """Return once no request uses ``lora_id`` (it must be unregistered already)."""
        if lora_id not in self._counters:
            return
        async with self._zero:
            await self._zero.wait_for(lambda: self._counters.get(lora_id, 0) <= 0)
        self._counters.pop(lora_id, None)

    def check_request(self, names: Sequence[str | None]) -> None:
        """tokenizer_manager.py ``_validate_and_resolve_lora`` up to the reload of unloaded adapters.

        Raises:
            ValueError: LoRA not enabled, too many distinct adapters, or a name never loaded.
        """
        if not self.enabled:
            first = next((name for name in names if name), None)
            raise ValueError(
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        unique = set(names)
        limit = self.settings.max_loaded_loras
        if limit is not None and len(unique) > limit:
            raise ValueError(
                f"Received request with {len(unique)} unique loras requested but max loaded loras is {limit}"
            )

    def never_loaded(self, name: str) -> ValueError:
        """The error of a request naming an adapter this server never loaded."""
        return ValueError(
            f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {_dict_keys(self.ref_cache)}."
        )


# ----- per-row adapter deltas in a real model -----------------------------------------------------
def model_target_modules(model: Any) -> set[str]:
    """Normalized names of the model's ``Linear`` modules SGLang supports (``auto_detect_lora_target_modules``)."""
    import torch

    supported = set(SUPPORTED_LORA_TARGET_MODULES)
    names: set[str] = set()
    for name, module in model.named_modules():
        leaf = name.split(".")[-1]
        if isinstance(module, torch.nn.Linear) and leaf in supported:
            names |= normalized_target_modules([leaf])
    return names


@dataclasses.dataclass(frozen=True)
class AdapterWeights:
    """One adapter's tensors, per target module: ``A`` (rank, in) and ``B`` (out, rank), zero-padded to the max rank."""

    scaling: float
    modules: Mapping[str, tuple[Any, Any]]


def load_adapter_weights(path: str, config: AdapterConfig, model: Any, max_rank: int) -> AdapterWeights:
    """Read an adapter's safetensors and match every tensor to a ``Linear`` of ``model``.

    Other tensors of ``embed_tokens`` / ``lm_head`` are skipped, as SGLang's ``LoRAAdapter._process_weight``
    (sglang/srt/lora/lora.py) keeps them aside and its mem_pool.py loads only their LoRA halves: PEFT's
    ``save_pretrained`` writes the base's (tied) ``lm_head.base_layer.weight`` beside an ``lm_head`` adapter.

    Raises:
        ValueError: No weights file, a key that is not a PEFT LoRA key of a ``Linear`` of the model,
            a missing half, or shapes that do not fit the module.
    """
    import torch
    from safetensors.torch import load_file

    file = adapter_weights_path(path)
    if not file.is_file():
        raise ValueError(f"No adapter weights found at {file}")
    tensors = load_file(str(file))
    modules = dict(model.named_modules())
    halves: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        for half in ("lora_A", "lora_B"):
            suffix = f".{half}.weight"
            if key.startswith(_PEFT_PREFIX) and key.endswith(suffix):
                halves.setdefault(key[len(_PEFT_PREFIX) : -len(suffix)], {})[half] = tensor
                break
        else:
            if ("embed_tokens" in key or "lm_head" in key) and "lora_" not in key:
                continue  # a base tensor saved beside the adapter; an embedding's LoRA halves still fail here
            raise ValueError(f"unexpected tensor {key!r} in {file} (PEFT LoRA keys only)")
    weights: dict[str, tuple[Any, Any]] = {}
    for name, pair in halves.items():
        module = modules.get(name)
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(f"LoRA weights of {name!r}: the base model has no Linear module of that name")
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA weights of {name!r} lack {sorted({'lora_A', 'lora_B'} - set(pair))}")
        lora_a, lora_b = pair["lora_A"].float(), pair["lora_B"].float()
        rank = config.r
        if tuple(lora_a.shape) != (rank, module.in_features) or tuple(lora_b.shape) != (module.out_features, rank):
            raise ValueError(
                f"LoRA weights of {name!r} have shapes {tuple(lora_a.shape)} and {tuple(lora_b.shape)}; "
                f"rank {rank} over {module.in_features} -> {module.out_features} needs "
                f"{(rank, module.in_features)} and {(module.out_features, rank)}"
            )
        padded_a = torch.zeros(max_rank, module.in_features)
        padded_a[:rank] = lora_a
        padded_b = torch.zeros(module.out_features, max_rank)
        padded_b[:, :rank] = lora_b
        weights[name] = (padded_a, padded_b)
    return AdapterWeights(config.scaling, weights)


class _ActiveRows:
    """The adapter of every row of one forward pass, and its stacked tensors per module (built on first use)."""

    def __init__(self, lora_ids: Sequence[str | None], adapters: Mapping[str, AdapterWeights], max_rank: int) -> None:
        self.lora_ids = list(lora_ids)
        self.adapters = adapters
        self.max_rank = max_rank
        self._stacks: dict[str, tuple[Any, Any, Any] | None] = {}

    def stacks(self, name: str, module: Any) -> tuple[Any, Any, Any] | None:
        import torch

        if name in self._stacks:
            return self._stacks[name]
        zero_a = torch.zeros(self.max_rank, module.in_features)
        zero_b = torch.zeros(module.out_features, self.max_rank)
        a_rows, b_rows, scales, used = [], [], [], False
        for lora_id in self.lora_ids:
            adapter = self.adapters.get(lora_id) if lora_id is not None else None
            pair = adapter.modules.get(name) if adapter is not None else None
            used = used or pair is not None
            a_rows.append(pair[0] if pair is not None else zero_a)
            b_rows.append(pair[1] if pair is not None else zero_b)
            scales.append(adapter.scaling if adapter is not None and pair is not None else 0.0)
        stack = (torch.stack(a_rows), torch.stack(b_rows), torch.tensor(scales).view(-1, 1, 1)) if used else None
        self._stacks[name] = stack
        return stack


_HOOKED_MARK = "_flexmarl_lora_layers"


class LoraLayers:
    """Per-row LoRA deltas in the target ``Linear`` modules of the served model(s).

    Forward hooks on each target module add ``(x @ A_row^T) @ B_row^T * scaling_row`` for the
    rows of an adapter (a gather of each row's padded A and B, then a batched matmul) while
    :meth:`rows` is active; a base row gathers zeros, and a pass with no adapter row runs no
    hook code at all, so the base model is served bit-identically.
    """

    def __init__(self, max_rank: int) -> None:
        self.max_rank = max_rank
        self.adapters: dict[str, AdapterWeights] = {}
        self._active: _ActiveRows | None = None

    def _hook(self, model: Any) -> None:
        """Hook the model's supported ``Linear`` modules once (a marker on the model says it is done)."""
        import torch

        if getattr(model, _HOOKED_MARK, None) is self:
            return
        supported = set(SUPPORTED_LORA_TARGET_MODULES)
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in supported:
                module.register_forward_hook(self._delta_hook(name))
        setattr(model, _HOOKED_MARK, self)

    def _delta_hook(self, name: str) -> Any:
        import torch

        def hook(module: Any, args: tuple[Any, ...], output: Any) -> Any:
            active = self._active
            if active is None:
                return None
            stack = active.stacks(name, module)
            if stack is None:
                return None
            lora_a, lora_b, scales = stack
            x = args[0]
            if x.shape[0] != lora_a.shape[0]:
                raise RuntimeError(f"LoRA rows: {lora_a.shape[0]} adapters for a batch of {x.shape[0]} in {name}")
            hidden = torch.matmul(x, lora_a.transpose(1, 2))
            return output + torch.matmul(hidden, lora_b.transpose(1, 2)) * scales

        return hook

    @contextlib.contextmanager
    def rows(self, model: Any, lora_ids: Sequence[str | None]) -> Iterator[None]:
        """Within the block, forward passes of ``model`` add each row's adapter delta (None: the base)."""
        if all(lora_id is None for lora_id in lora_ids):
            yield
            return
        self._hook(model)
        self._active = _ActiveRows(lora_ids, dict(self.adapters), self.max_rank)
        try:
            yield
        finally:
            self._active = None


def adapter_transfer_s(link_bytes_per_s: float, num_params: int, bytes_per_param: float) -> float:
    """Modelled seconds to move an adapter of ``num_params`` parameters over the link."""
    return num_params * bytes_per_param / link_bytes_per_s
