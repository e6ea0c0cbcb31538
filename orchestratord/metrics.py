"""Prometheus metrics of orchestratord (registered into the daemon's own registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flexmarl.metrics import LATENCY_BUCKETS_S


class OrchestratorMetrics:
    """Jobs, leases, steps."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs_submitted = Counter("flexmarl_orchestratord_jobs_submitted_total", "Jobs accepted.",
                                      registry=registry)
        self.tasks_leased = Counter("flexmarl_orchestratord_rollout_tasks_leased_total",
                                    "Rollout task leases issued (re-issues included).", registry=registry)
        self.tasks_reported = Counter("flexmarl_orchestratord_rollout_tasks_reported_total",
                                      "Rollout task reports, by outcome (ok, failed: re-issued, given_up: too few "
                                      "episodes left after their rewards failed; an eval task: any of its rewards "
                                      "failed) and kind (train, eval: a held-out evaluation task).",
                                      ["outcome", "kind"], registry=registry)
        self.episodes_failed = Counter("flexmarl_orchestratord_episodes_failed_total",
                                       "Episodes dropped from their tasks because their reward failed (raised, "
                                       "timed out, gave no finite number).", registry=registry)
        self.micro_batches_acked = Counter("flexmarl_orchestratord_micro_batches_acked_total",
                                           "Micro-batches whose gradients were accumulated.", registry=registry)
        self.steps_committed = Counter("flexmarl_orchestratord_steps_committed_total",
                                       "Optimizer steps committed, by job and agent.", ["job", "agent"],
                                       registry=registry)
        self.step_seconds = Histogram("flexmarl_orchestratord_step_seconds",
                                      "Wall time between consecutive commits of an agent.", ["agent"],
                                      buckets=(*LATENCY_BUCKETS_S, 30.0, 60.0, 120.0, 300.0), registry=registry)
        self.staleness = Histogram("flexmarl_orchestratord_step_staleness_versions",
                                   "Mean (step - behaviour version) of the experiences of a committed step.",
                                   buckets=(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0), registry=registry)
        self.bound_slots = Gauge("flexmarl_orchestratord_bound_slots", "Trainer slots bound to an agent.",
                                 registry=registry)
        self.known_slots = Gauge("flexmarl_orchestratord_known_slots", "Trainer slots seen polling.",
                                 registry=registry)
        self.bubble_seconds = Counter("flexmarl_orchestratord_pipeline_bubble_seconds_total",
                                      "Slot-seconds without trainer work while a job was running (pipeline "
                                      "bubbles; includes slots waiting on rollouts).", registry=registry)
        self.rollout_demand_tokens = Gauge("flexmarl_orchestratord_rollout_demand_tokens",
                                           "Estimated outstanding generation tokens, by agent.", ["job", "agent"],
                                           registry=registry)
