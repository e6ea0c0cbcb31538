"""rolloutd settings."""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import shlex
from collections.abc import Callable, Mapping

from flexmarl.config import ConfigError, DaemonConfig
from flexmarl.devices import DeviceSet, device_pool, nvidia_smi_device_count, split_device_sets
from flexmarl.errors import InvalidArgument
from rolloutd.task_limit import AUTO, AUTO_FLOOR, DEFAULT_CAP, MAX_TASKS_LIMIT

# Refused rather than turned off behind the user's back: the default (on) promises reproducible runs.
_VLLM_NOT_DETERMINISTIC = ("engine_deterministic_inference: vLLM replicas honour per-request seeds but have no "
                           "batch-invariant mode; set it false for engine_backend vllm "
                           "(--no-engine-deterministic-inference)")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclasses.dataclass(frozen=True)
class EnginePathMap:
    """How a path in rolloutd's filesystem is named on the hosts of attached engines (a shared filesystem).

    An engine attached by URL runs elsewhere; ``/update_weights_from_disk`` must name the
    checkpoint as *that* host sees it. Each rule maps a local prefix to the engine's prefix
    (the longest matching prefix wins, on whole path components). Without rules the path is
    sent unchanged (the engines mount the filesystem at the same path). With rules, a path
    under no prefix is an error: it would name a file the engine cannot see.
    """

    rules: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> EnginePathMap:
        """Parses ``"LOCAL_PREFIX=ENGINE_PREFIX[,...]"``; raises ConfigError when malformed."""
        rules = []
        for item in filter(None, (i.strip() for i in text.split(","))):
            local, sep, remote = item.partition("=")
            local, remote = local.strip(), remote.strip()
            if not sep or not posixpath.isabs(local) or not posixpath.isabs(remote):
                raise ConfigError(f"engine_path_map: {item!r} is not LOCAL_PREFIX=ENGINE_PREFIX (absolute paths)")
            rules.append((posixpath.normpath(local), posixpath.normpath(remote)))
        return cls(tuple(sorted(rules, key=lambda rule: len(rule[0]), reverse=True)))

    def to_engine(self, path: str) -> str:
        """The engine's name for a local path.

        Raises:
            InvalidArgument: rules are set and none covers ``path``.
        """
        if not self.rules:
            return path
        normal = posixpath.normpath(path)
        for local, remote in self.rules:
            if normal == local or normal.startswith(local.rstrip("/") + "/"):
                return remote + normal[len(local):] if local != "/" else posixpath.join(remote, normal[1:])
        prefixes = ", ".join(local for local, _ in self.rules)
        raise InvalidArgument(f"{path} is outside every engine_path_map prefix ({prefixes}): the attached engines "
                              f"cannot read it; map its directory or put it on the shared filesystem")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(DaemonConfig):
    """Settings of rolloutd (flags, FLEXMARL_* env, or a config file)."""

    orchestrator_address: str = dataclasses.field(
        default="", metadata=_help("orchestratord host:port (default: discovered in etcd)"))
    store_address: str = dataclasses.field(default="", metadata=_help("stored host:port (default: discovered)"))
    max_tasks: str = dataclasses.field(
        default=AUTO, metadata=_help("rollout tasks leased at once: auto (the served jobs' (max_staleness + 1) x "
                                     "prompts_per_step, summed and shared among the live rolloutds, rounded up; "
                                     f"never below {AUTO_FLOOR} nor above max_tasks_cap) or a number "
                                     f"1..{MAX_TASKS_LIMIT}"))
    max_tasks_cap: int = dataclasses.field(
        default=DEFAULT_CAP, metadata=_help("max_tasks auto leases at most this many tasks at once (each holds "
                                            "group_size episodes in memory)"))
    work_dir: str = dataclasses.field(default="rolloutd-work", metadata=_help("engine logs and weight cache"))
    weights_cache_dir: str = dataclasses.field(
        default="", metadata=_help("where stored:// checkpoints are unpacked for the engines "
                                   "(default <work_dir>/weights; a shared filesystem for attached engines)"))
    engine_backend: str = dataclasses.field(
        default="embedded", metadata=_help("replicas to launch or attach: embedded (CPU), sglang (GPU hosts) "
                                           "or vllm (CPU or GPU; launched with vllm_python)"))
    vllm_python: str = dataclasses.field(
        default="", metadata=_help("engine_backend vllm: the python of the virtual environment vLLM is "
                                   "installed in (./dev.sh test installs one: .venv-vllm/bin/python)"))
    engine_replicas: int = dataclasses.field(default=2, metadata=_help("replicas to launch"))
    engine_urls: str = dataclasses.field(
        default="", metadata=_help("comma-separated http://host:port of running replicas (no launch)"))
    engine_threads: int = dataclasses.field(default=1, metadata=_help("torch threads per embedded replica"))
    engine_tp_size: int = dataclasses.field(
        default=1, metadata=_help("devices per launched SGLang replica (its --tp-size); embedded: 1"))
    gpus: str = dataclasses.field(
        default="", metadata=_help("devices the launched replicas share out, engine_tp_size each "
                                   "(default: CUDA_VISIBLE_DEVICES, else every GPU; none: assign none)"))
    engine_deterministic_inference: bool = dataclasses.field(
        default=True, metadata=_help("launch replicas with --enable-deterministic-inference: seeded, "
                                     "batch-invariant sampling (reproducible runs; slower on SGLang)"))
    engine_launch_timeout_s: float = dataclasses.field(
        default=600.0, metadata=_help("how long a launched replica may take to become healthy "
                                      "(SGLang loads weights and captures CUDA graphs first)"))
    engine_extra_args: str = dataclasses.field(
        default="", metadata=_help("extra command-line flags for every launched replica (shell-quoted)"))
    engine_path_map: str = dataclasses.field(
        default="", metadata=_help("LOCAL_PREFIX=ENGINE_PREFIX[,...]: how attached engines (engine_urls) "
                                   "name rolloutd's checkpoint paths on a shared filesystem"))
    engine_max_loras_per_batch: int = dataclasses.field(
        default=8, metadata=_help("LoRA agents' replicas: most distinct adapters in one batch "
                                  "(SGLang's --max-loras-per-batch; the router keeps each replica within it)"))
    engine_max_loaded_loras: int = dataclasses.field(
        default=0, metadata=_help("LoRA agents' replicas: most adapters loaded at once "
                                  "(SGLang's --max-loaded-loras; 0: no bound)"))
    balancer_measured_rates: bool = dataclasses.field(
        default=True, metadata=_help("the hierarchical balancer decides on each replica's measured tokens/s and "
                                     "the measured seconds of a weight load (false: on the two priors below "
                                     "alone, as before measurement)"))
    balancer_tokens_per_s: float = dataclasses.field(
        default=1000.0, metadata=_help("the balancer's rate of a replica until it is measured (tokens/s)"))
    balancer_reassignment_cost_s: float = dataclasses.field(
        default=10.0, metadata=_help("the balancer's cost of a replica move (one weight load) until one is measured"))
    balancer_move_patience: float = dataclasses.field(
        default=1.0, metadata=_help("a planned replica move is made once every rebalance has wanted it for this "
                                    "multiple of its estimated cost, its drain and weight load (ski rental: demand "
                                    "that turns faster than a move completes is not chased); the first moves of "
                                    "a group at once; 0: every move at once"))
    balancer_move_evicts: bool = dataclasses.field(
        default=False, metadata=_help("a replica moved away from a partial-rollout agent aborts its generations, "
                                      "which go on on the agent's other replicas with their tokens so far, and "
                                      "loads at once (default: it drains them first, as for other agents; "
                                      "measured no faster, docs/benchmarks.md)"))
    balancer_dispatch_kv_factor: float = dataclasses.field(
        default=0.0, metadata=_help("> 0: a replica takes a request only while its requests' reserved KV tokens "
                                    "(prompt + max_new_tokens each) stay within this factor of its engine's "
                                    "max_total_num_tokens; the rest wait in rolloutd, where a replica moved to "
                                    "their agent takes them (0: every request goes to an engine at once)"))

    def validate(self) -> None:
        """Raises ConfigError on an out-of-range value."""
        super().validate()
        if not 0 < self.balancer_tokens_per_s < float("inf"):
            raise ConfigError(f"balancer_tokens_per_s: must be > 0, got {self.balancer_tokens_per_s}")
        if not 0 <= self.balancer_reassignment_cost_s < float("inf"):
            raise ConfigError(f"balancer_reassignment_cost_s: must be >= 0, got {self.balancer_reassignment_cost_s}")
        if not 0 <= self.balancer_move_patience < float("inf"):
            raise ConfigError(f"balancer_move_patience: must be >= 0, got {self.balancer_move_patience}")
        if not 0 <= self.balancer_dispatch_kv_factor < float("inf"):
            raise ConfigError(f"balancer_dispatch_kv_factor: must be >= 0, got {self.balancer_dispatch_kv_factor}")
        if not 1 <= self.engine_max_loras_per_batch <= 1024:
            raise ConfigError(f"engine_max_loras_per_batch: must be in 1..1024, got {self.engine_max_loras_per_batch}")
        if self.engine_max_loaded_loras and self.engine_max_loaded_loras < self.engine_max_loras_per_batch:
            raise ConfigError(f"engine_max_loaded_loras: must be 0 or >= engine_max_loras_per_batch "
                              f"({self.engine_max_loras_per_batch}), got {self.engine_max_loaded_loras}")
        self.explicit_max_tasks()
        if not AUTO_FLOOR <= self.max_tasks_cap <= MAX_TASKS_LIMIT:
            raise ConfigError(f"max_tasks_cap: must be in {AUTO_FLOOR}..{MAX_TASKS_LIMIT} (max_tasks auto never "
                              f"leases fewer than {AUTO_FLOOR}), got {self.max_tasks_cap}")
        if self.engine_backend not in ("embedded", "sglang", "vllm"):
            raise ConfigError(f"engine_backend: must be embedded, sglang or vllm, got {self.engine_backend!r}")
        self._validate_vllm()
        if not 1 <= self.engine_replicas <= 1024:
            raise ConfigError(f"engine_replicas: must be in 1..1024, got {self.engine_replicas}")
        if not 1 <= self.engine_threads <= 256:
            raise ConfigError(f"engine_threads: must be in 1..256, got {self.engine_threads}")
        if not 1 <= self.engine_tp_size <= 64:
            raise ConfigError(f"engine_tp_size: must be in 1..64, got {self.engine_tp_size}")
        if self.engine_backend == "embedded" and self.engine_tp_size != 1:
            raise ConfigError("engine_tp_size: the embedded engine runs on one device (tensor parallelism is SGLang's)")
        if not self.engine_launch_timeout_s > 0:
            raise ConfigError(f"engine_launch_timeout_s: must be > 0, got {self.engine_launch_timeout_s}")
        for url in self.engine_url_list():
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"engine_urls: {url!r} is not http(s)://host:port")
        self.engine_arg_list()
        if self.path_map().rules and not self.engine_url_list():
            raise ConfigError("engine_path_map: applies to engines attached by engine_urls "
                              "(launched replicas share rolloutd's filesystem)")
        if not self.engine_url_list():
            self.engine_device_sets()

    def _validate_vllm(self) -> None:
        """What a vLLM replica cannot be asked, refused in one line naming the setting."""
        if self.engine_backend != "vllm":
            if self.vllm_python:
                raise ConfigError(f"vllm_python: applies to engine_backend vllm, not {self.engine_backend}")
            return
        if not self.engine_url_list():
            self._validate_vllm_launch()
        if self.engine_deterministic_inference:
            raise ConfigError(_VLLM_NOT_DETERMINISTIC)

    def _validate_vllm_launch(self) -> None:
        if not self.vllm_python:
            raise ConfigError("vllm_python: engine_backend vllm launches its replicas with the python of vLLM's "
                              "virtual environment; set it (./dev.sh test installs .venv-vllm/bin/python)")
        if not os.path.isfile(self.vllm_python) or not os.access(self.vllm_python, os.X_OK):
            raise ConfigError(f"vllm_python: {self.vllm_python} is not an executable file")

    def explicit_max_tasks(self) -> int | None:
        """``max_tasks`` as a number, or None for ``auto``; raises ConfigError when it is neither."""
        text = self.max_tasks.strip().lower()
        if text == AUTO:
            return None
        if re.fullmatch(r"[0-9]+", text) and 1 <= int(text) <= MAX_TASKS_LIMIT:
            return int(text)
        raise ConfigError(f"max_tasks: must be auto or a number in 1..{MAX_TASKS_LIMIT}, got {self.max_tasks!r}")

    def engine_url_list(self) -> tuple[str, ...]:
        """The attached engines' URLs (empty: rolloutd launches its replicas)."""
        return tuple(u.strip() for u in self.engine_urls.split(",") if u.strip())

    def engine_arg_list(self) -> tuple[str, ...]:
        """``engine_extra_args`` split as a shell would; raises ConfigError when unbalanced."""
        try:
            return tuple(shlex.split(self.engine_extra_args))
        except ValueError as exc:
            raise ConfigError(f"engine_extra_args: {exc}") from None

    def path_map(self) -> EnginePathMap:
        """The parsed ``engine_path_map``."""
        return EnginePathMap.parse(self.engine_path_map)

    def engine_device_sets(
        self, env: Mapping[str, str] | None = None,
        host_device_count: Callable[[], int] = nvidia_smi_device_count,
    ) -> tuple[DeviceSet, ...] | None:
        """One device set per launched replica (``engine_tp_size`` devices each), or None to assign none.

        None when the pool is empty (a CPU host, or ``gpus=none``): replicas inherit rolloutd's view.
        None as well for the embedded backend unless ``gpus`` names devices: it computes on the CPU,
        so a GPU host with fewer GPUs than embedded replicas is no configuration error.

        Raises:
            ConfigError: the pool has fewer than ``engine_replicas * engine_tp_size`` devices.
        """
        if self.engine_backend == "embedded" and not self.gpus.strip():
            return None
        pool = device_pool(self.gpus, os.environ if env is None else env, host_device_count)
        if not pool:
            return None
        return tuple(split_device_sets(pool, self.engine_replicas, self.engine_tp_size, "gpus"))
