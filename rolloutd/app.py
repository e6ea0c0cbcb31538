"""Wires rolloutd's worker and servicer into the shared daemon lifecycle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc.aio

from flexmarl.daemon import DaemonApp, DaemonContext
from flexmarl.engine_limits import INFO_KEY as ENGINE_LIMITS_KEY
from flexmarl.engine_limits import EngineLimits
from flexmarl.v1 import rollout_pb2_grpc
from rolloutd.config import RolloutConfig
from rolloutd.engines.vllm.jobs import vllm_limits
from rolloutd.metrics import RolloutMetrics
from rolloutd.servicer import RolloutServicer
from rolloutd.worker import RolloutWorker, WorkerSettings


class RolloutApp(DaemonApp):
    """rolloutd: the rollout worker behind the Rollout service."""

    service_names = ("flexmarl.v1.Rollout",)

    def __init__(self, config: RolloutConfig, ctx: DaemonContext) -> None:
        self.config = config
        engine_urls = config.engine_url_list()
        settings = WorkerSettings(
            worker_id=ctx.service_id, work_dir=Path(config.work_dir).resolve(), max_tasks=config.explicit_max_tasks(),
            engine_backend=config.engine_backend, engine_replicas=config.engine_replicas,
            engine_urls=engine_urls, engine_threads=config.engine_threads,
            orchestrator_address=config.orchestrator_address, store_address=config.store_address,
            max_message_bytes=config.max_message_bytes, security=ctx.security,
            engine_tp_size=config.engine_tp_size,
            engine_device_sets=None if engine_urls else config.engine_device_sets(),
            deterministic_inference=config.engine_deterministic_inference,
            engine_launch_timeout_s=config.engine_launch_timeout_s, engine_extra_args=config.engine_arg_list(),
            engine_path_map=config.path_map(),
            engine_max_loras_per_batch=config.engine_max_loras_per_batch,
            engine_max_loaded_loras=config.engine_max_loaded_loras or None,
            weights_cache_dir=Path(config.weights_cache_dir).resolve() if config.weights_cache_dir else None,
            vllm_python=config.vllm_python,
            balancer_measured_rates=config.balancer_measured_rates, balancer_tokens_per_s=config.balancer_tokens_per_s,
            balancer_reassignment_cost_s=config.balancer_reassignment_cost_s,
            balancer_dispatch_kv_factor=config.balancer_dispatch_kv_factor,
            balancer_move_patience=config.balancer_move_patience,
            balancer_move_evicts=config.balancer_move_evicts,
            max_tasks_cap=config.max_tasks_cap,
        )
        self.worker = RolloutWorker(settings, ctx.registry, RolloutMetrics(ctx.metrics))

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Adds the Rollout service."""
        rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(self.worker), server)

    async def start(self) -> None:
        """Starts pulling tasks."""
        await self.worker.start()

    async def stop(self) -> None:
        """Stops the worker and its engines."""
        await self.worker.stop()

    def registration_info(self) -> dict[str, Any]:
        """Advertises the engine pool."""
        settings = self.worker.settings
        devices = settings.engine_device_sets
        if settings.engine_backend == "vllm":  # orchestratord refuses at submission what they cannot serve
            limits = vllm_limits(on_cpu=not settings.engine_urls and devices is None)
        else:
            limits = EngineLimits(backend=settings.engine_backend)
        return {"engine_backend": self.config.engine_backend, "engine_replicas": self.config.engine_replicas,
                "engine_devices": [str(d) for d in devices] if devices is not None else [],
                ENGINE_LIMITS_KEY: limits.to_info()}


def build_app(config: RolloutConfig, ctx: DaemonContext) -> DaemonApp:
    """Builds the app for daemon.main."""
    return RolloutApp(config, ctx)
