"""Prometheus metrics of traind (registered into the daemon's own registry)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flexmarl.metrics import LATENCY_BUCKETS_S

_SLOW_BUCKETS_S = (*LATENCY_BUCKETS_S, 30.0, 60.0, 120.0, 300.0)


class TrainerMetrics:
    """Slot utilisation, tokens trained, steps, swaps, losses."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.busy_fraction = Gauge("flexmarl_traind_slot_busy_fraction", "Fraction of time a slot was working.",
                                   ["slot"], registry=registry)
        self.micro_batches = Counter("flexmarl_traind_micro_batches_total", "Micro-batches accumulated, by agent.",
                                     ["agent"], registry=registry)
        self.tokens = Counter("flexmarl_traind_trained_tokens_total", "Response tokens trained on, by agent.",
                              ["agent"], registry=registry)
        self.step_seconds = Histogram("flexmarl_traind_step_seconds",
                                      "Optimizer step + publish + state save, by agent.", ["agent"],
                                      buckets=_SLOW_BUCKETS_S, registry=registry)
        self.swap_seconds = Histogram("flexmarl_traind_swap_seconds", "Agent state moves, by direction.",
                                      ["direction"], buckets=_SLOW_BUCKETS_S, registry=registry)
        self.swap_bytes = Counter("flexmarl_traind_swap_bytes_total", "Bytes of agent state moved, by direction.",
                                  ["direction"], registry=registry)
        self.loss = Gauge("flexmarl_traind_loss", "Loss of the last step, by agent.", ["agent"], registry=registry)
        self.grad_norm = Gauge("flexmarl_traind_grad_norm", "Gradient norm of the last step, by agent.", ["agent"],
                               registry=registry)
        self.clip_fraction = Gauge("flexmarl_traind_clip_fraction", "Clipped-token fraction of the last step.",
                                   ["agent"], registry=registry)
        self.kl = Gauge("flexmarl_traind_kl", "KL to the reference of the last step.", ["agent"], registry=registry)

    def observe_busy(self, slot: Any) -> None:
        """Updates a slot's busy fraction."""
        import time

        self.busy_fraction.labels(slot.slot_id).set(slot.busy_s / max(1e-9, time.monotonic() - slot.started_s))

    def observe_micro_batch(self, agent: str, tokens: int, seconds: float) -> None:
        """Records one accumulated micro-batch."""
        self.micro_batches.labels(agent).inc()
        self.tokens.labels(agent).inc(tokens)

    def observe_step(self, agent: str, stats: Any, seconds: float) -> None:
        """Records one optimizer step."""
        self.step_seconds.labels(agent).observe(seconds)
        self.loss.labels(agent).set(stats.loss)
        self.grad_norm.labels(agent).set(stats.grad_norm)
        self.clip_fraction.labels(agent).set(stats.clip_fraction)
        self.kl.labels(agent).set(stats.kl)

    def observe_swap(self, direction: str, moved: int, seconds: float) -> None:
        """Records one state move."""
        self.swap_seconds.labels(direction).observe(seconds)
        self.swap_bytes.labels(direction).inc(moved)
