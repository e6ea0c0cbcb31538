"""Where rolloutd's replicas run and how they are launched: devices, flags, launch deadline.

The pure builders (command line, child environment, config -> device sets) are checked
directly; the real-child tests launch embedded engines through RolloutWorker._ensure_engines
and read each child's environment and command line from /proc.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import types
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from flexmarl.config import ConfigError, load_config
from flexmarl.devices import DeviceSet
from flexmarl.errors import InvalidArgument, Unavailable
from flexmarl.jobspec import JobSpec
from flexmarl.registry import Registry
from rolloutd.config import RolloutConfig
from rolloutd.engines import launcher
from rolloutd.engines.launcher import EngineReplica, ReplicaSpec, attach, embedded_command, replica_env, sglang_command
from rolloutd.metrics import RolloutMetrics
from rolloutd.worker import RolloutWorker, WorkerSettings, replica_specs


def _settings(tmp_path: Path, **overrides: Any) -> WorkerSettings:
    fields: dict[str, Any] = dict(
        worker_id="rolloutd-test", work_dir=tmp_path, max_tasks=2, engine_backend="embedded", engine_replicas=2,
        engine_urls=(), engine_threads=1, orchestrator_address="127.0.0.1:9", store_address="127.0.0.1:9",
        max_message_bytes=64 * 1024 * 1024,
    )
    fields.update(overrides)
    return WorkerSettings(**fields)


def _worker(settings: WorkerSettings) -> RolloutWorker:
    # No etcd: these tests never look a peer up (the registry is only stored by PeerConnections).
    return RolloutWorker(settings, cast(Registry, object()), RolloutMetrics(CollectorRegistry()))


def _job_spec(model: Path) -> JobSpec:
    """The two fields _ensure_engines reads (the first agent's model, the balancing policy)."""
    return cast(JobSpec, types.SimpleNamespace(agents=[types.SimpleNamespace(model=str(model))],
                                               balancing="hierarchical"))


def _child_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def _child_argv(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]


# ---- pure builders ---------------------------------------------------------------------------


def test_sglang_replica_gets_its_devices_base_gpu_id_and_deterministic_flag() -> None:
    spec = ReplicaSpec("sglang", "/ckpt", tp_size=2, devices=DeviceSet(("2", "3")), deterministic_inference=True)
    command = sglang_command(spec, 30000)
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    # --base-gpu-id indexes CUDA_VISIBLE_DEVICES (sglang/srt/entrypoints/engine.py): 0 = the set's first device.
    assert flags["--base-gpu-id"] == "0" and flags["--tp-size"] == "2"
    assert "--enable-deterministic-inference" in command
    env = replica_env(spec, {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and env["PATH"] == "/bin"
    assert replica_env(spec, {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_replica_without_devices_inherits_and_runs_no_deterministic_flag_by_default() -> None:
    spec = ReplicaSpec("sglang", "/ckpt")
    command = sglang_command(spec, 30000)
    assert "--base-gpu-id" not in command and "--enable-deterministic-inference" not in command
    assert replica_env(spec, {"CUDA_VISIBLE_DEVICES": "4"}) == {"CUDA_VISIBLE_DEVICES": "4"}
    embedded = embedded_command(ReplicaSpec("embedded", "/ckpt", deterministic_inference=True), Path("/r.json"))
    assert "--enable-deterministic-inference" in embedded


def test_sglang_replica_with_fewer_devices_than_tp_size_is_refused() -> None:
    spec = ReplicaSpec("sglang", "/ckpt", tp_size=2, devices=DeviceSet(("0",)))
    with pytest.raises(InvalidArgument, match="tp-size 2 needs 2 devices"):
        replica_env(spec, {})


def _no_host_devices() -> int:
    return 0


def test_config_cuts_the_pool_into_one_set_per_replica() -> None:
    sglang = RolloutConfig(engine_backend="sglang", engine_replicas=2, engine_tp_size=2, gpus="4,5,6,7")
    sets = sglang.engine_device_sets(env={}, host_device_count=_no_host_devices)
    assert sets == (DeviceSet(("4", "5")), DeviceSet(("6", "7")))
    # No gpus setting: the daemon's own CUDA_VISIBLE_DEVICES, then every device of the host.
    from_env = RolloutConfig(engine_backend="sglang", engine_replicas=2).engine_device_sets(
        env={"CUDA_VISIBLE_DEVICES": "1,3"}, host_device_count=_no_host_devices)
    assert from_env == (DeviceSet(("1",)), DeviceSet(("3",)))
    from_host = RolloutConfig(engine_backend="sglang", engine_replicas=3).engine_device_sets(
        env={}, host_device_count=lambda: 4)
    assert from_host == (DeviceSet(("0",)), DeviceSet(("1",)), DeviceSet(("2",)))
    # Embedded replicas compute on the CPU: they get devices only where gpus names them, so the
    # default two replicas on a one-GPU host are no configuration error.
    assert RolloutConfig(engine_replicas=2).engine_device_sets(env={}, host_device_count=lambda: 1) is None
    # A CPU host, or gpus=none: nothing is assigned (the replicas inherit rolloutd's view).
    assert RolloutConfig().engine_device_sets(env={}, host_device_count=_no_host_devices) is None
    assert RolloutConfig(gpus="none").engine_device_sets(env={}, host_device_count=lambda: 8) is None
    for hidden in ("", "-1"):  # CUDA's spellings of "no device": the host's devices are not rolloutd's
        assert RolloutConfig().engine_device_sets(env={"CUDA_VISIBLE_DEVICES": hidden}, host_device_count=lambda: 8) \
            is None


def test_too_few_devices_or_foreign_devices_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"2 x 2 device\(s\) needed, but only 3"):
        RolloutConfig(engine_backend="sglang", engine_replicas=2, engine_tp_size=2,
                      gpus="0,1,2").engine_device_sets(env={}, host_device_count=_no_host_devices)
    with pytest.raises(ConfigError, match="not in this daemon's CUDA_VISIBLE_DEVICES"):
        RolloutConfig(engine_replicas=1, gpus="5").engine_device_sets(env={"CUDA_VISIBLE_DEVICES": "0,1"},
                                                                      host_device_count=_no_host_devices)
    with pytest.raises(ConfigError, match="listed twice"):
        RolloutConfig(gpus="1,1").engine_device_sets(env={}, host_device_count=_no_host_devices)
    env = {"FLEXMARL_GPUS": "0,1,2", "FLEXMARL_ENGINE_REPLICAS": "2", "FLEXMARL_ENGINE_TP_SIZE": "2",
           "FLEXMARL_ENGINE_BACKEND": "sglang"}
    with pytest.raises(ConfigError, match="gpus: 2 x 2"):
        load_config(RolloutConfig, [], prog="rolloutd", env=env)
    with pytest.raises(ConfigError, match="engine_tp_size: the embedded engine runs on one device"):
        load_config(RolloutConfig, ["--engine-tp-size", "2"], prog="rolloutd", env={})


def test_launch_settings_come_from_flags() -> None:
    config = load_config(RolloutConfig, ["--engine-launch-timeout-s", "1800", "--no-engine-deterministic-inference",
                                         "--engine-extra-args", "--attention-backend fa3 --max-running-requests 64"],
                         prog="rolloutd", env={})
    assert config.engine_launch_timeout_s == 1800.0 and config.engine_deterministic_inference is False
    assert config.engine_arg_list() == ("--attention-backend", "fa3", "--max-running-requests", "64")
    assert RolloutConfig().engine_deterministic_inference is True  # strict sync==async equivalence needs it
    with pytest.raises(ConfigError, match="engine_launch_timeout_s"):
        load_config(RolloutConfig, ["--engine-launch-timeout-s", "0"], prog="rolloutd", env={})


def test_replica_specs_give_each_replica_its_set_and_the_flags(tmp_path: Path) -> None:
    sets = (DeviceSet(("0", "1")), DeviceSet(("2", "3")))
    settings = _settings(tmp_path, engine_backend="sglang", engine_tp_size=2, engine_device_sets=sets,
                         engine_extra_args=("--attention-backend", "fa3"))
    specs = replica_specs(settings, "/models/m")
    assert [s.devices for s in specs] == list(sets)
    assert all(s.tp_size == 2 and s.deterministic_inference and s.model_path == "/models/m" for s in specs)
    assert all(s.extra_args == ("--attention-backend", "fa3") for s in specs)
    assert [s.devices for s in replica_specs(_settings(tmp_path), "/m")] == [None, None]


# ---- the worker, with real and recorded launches ---------------------------------------------


async def test_ensure_engines_passes_the_configured_launch_timeout(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[ReplicaSpec, float]] = []

    async def recording_launch(spec: ReplicaSpec, run_dir: Path, *, timeout_s: float = 120.0,
                               name: str = "engine") -> EngineReplica:
        calls.append((spec, timeout_s))
        return attach("http://127.0.0.1:9")

    monkeypatch.setattr("rolloutd.worker.launch", recording_launch)
    settings = _settings(tmp_path, engine_launch_timeout_s=1234.0,
                         engine_device_sets=(DeviceSet(("0",)), DeviceSet(("1",))))
    worker = _worker(settings)
    await worker._ensure_engines(_job_spec(tmp_path / "model"))
    assert [timeout for _, timeout in calls] == [1234.0, 1234.0]
    assert [spec.devices for spec, _ in calls] == [DeviceSet(("0",)), DeviceSet(("1",))]
    await worker.stop()


@pytest.mark.timeout(240)
async def test_each_launched_replica_gets_its_own_devices_and_the_deterministic_flag(
    engine_checkpoint: Path, tmp_path: Path,
) -> None:
    # Device ids a CPU engine never opens: what is asserted is the environment each child got.
    config = RolloutConfig(engine_replicas=2, gpus="5,7")
    settings = _settings(tmp_path, engine_device_sets=config.engine_device_sets(env={}),
                         deterministic_inference=config.engine_deterministic_inference)
    worker = _worker(settings)
    try:
        await worker._ensure_engines(_job_spec(engine_checkpoint))
        pids = [engine.pid for engine in worker._engines]
        assert len(pids) == 2 and all(pid is not None for pid in pids)
        envs = [_child_env(cast(int, pid)) for pid in pids]
        assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["5", "7"]
        for pid in pids:
            argv = _child_argv(cast(int, pid))
            assert "rolloutd.engines.embedded" in argv and "--enable-deterministic-inference" in argv
    finally:
        await worker.stop()
    assert all(engine.process is not None and engine.process.poll() is not None for engine in worker._engines)


@pytest.mark.timeout(120)
async def test_a_replica_slower_than_the_launch_timeout_fails_the_launch(engine_checkpoint: Path,
                                                                        tmp_path: Path) -> None:
    # The embedded engine needs seconds to import torch: a 0.5 s deadline cannot be met. Before the
    # setting existed the worker always waited launch()'s fixed 120 s.
    settings = _settings(tmp_path, engine_replicas=1, engine_launch_timeout_s=0.5)
    worker = _worker(settings)
    started = time.monotonic()
    with pytest.raises(Unavailable, match="ready file|not healthy"):
        await worker._ensure_engines(_job_spec(engine_checkpoint))
    assert time.monotonic() - started < 30
    await worker.stop()


def test_launcher_names_the_sglang_file_of_every_flag() -> None:
    doc = launcher.__doc__ or ""
    command = sglang_command(dataclasses.replace(ReplicaSpec("sglang", "/c"), mem_fraction_static=0.5, seed=1,
                                                 devices=DeviceSet(("0",)), deterministic_inference=True), 1)
    for flag in (a for a in command if a.startswith("--")):
        assert f"``{flag}``" in doc, f"{flag} is not documented with its SGLang source file"
    assert sys.executable == command[0] and os.path.basename(command[2]) == "sglang.launch_server"


async def test_a_vllm_replica_gets_a_scratch_directory_for_its_sockets_removed_when_it_exits(tmp_path: Path) -> None:
    """vLLM binds its ZeroMQ IPC sockets under VLLM_RPC_BASE_PATH (the temp directory) and never removes them."""
    seen = tmp_path / "seen"
    python = tmp_path / "python"  # a "vLLM" that notes its socket directory and dies before it is healthy
    python.write_text(f'#!/bin/sh\n[ -d "$VLLM_RPC_BASE_PATH" ] && echo "$VLLM_RPC_BASE_PATH" > {seen}\nexit 3\n')
    python.chmod(0o755)
    spec = ReplicaSpec("vllm", "/ckpt", vllm_python=str(python), deterministic_inference=False)
    with pytest.raises(Unavailable, match="exited with 3"):
        await launcher.launch(spec, tmp_path / "run", timeout_s=30, name="engine-0")
    scratch = Path(seen.read_text().strip())
    assert scratch.name.startswith("flexmarl-engine-0-") and scratch.parent == Path(launcher.tempfile.gettempdir())
    assert not scratch.exists()  # removed with the failed launch
    # a base path the operator set is theirs: no scratch directory then
    named = dataclasses.replace(spec, env={"VLLM_RPC_BASE_PATH": str(tmp_path)})
    with pytest.raises(Unavailable, match="exited with 3"):
        await launcher.launch(named, tmp_path / "run", timeout_s=30, name="engine-0")
    assert seen.read_text().strip() == str(tmp_path)


def test_a_replicas_scratch_directory_outlives_no_stop_and_no_running_child(tmp_path: Path) -> None:
    import subprocess

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    replica = EngineReplica("http://127.0.0.1:1", subprocess.Popen(["sleep", "60"]), backend="vllm",
                            scratch_dir=scratch)
    replica.clear_scratch()
    assert scratch.is_dir()  # the child still runs (a relaunch clears it once the child exited)
    replica.stop(grace_s=5)
    assert not scratch.exists() and replica.scratch_dir is None
