"""Prometheus metrics of rolloutd (registered into the daemon's own registry)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from flexmarl.metrics import LATENCY_BUCKETS_S
from rolloutd.runner import RolloutResult
from rolloutd.weight_sync import SyncOutcome

_TASK_BUCKETS_S = (*LATENCY_BUCKETS_S, 30.0, 60.0, 120.0, 300.0)


class RolloutMetrics:
    """Tokens, tasks, episode latency, weight reloads."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.tokens = Counter("flexmarl_rolloutd_generated_tokens_total", "Response tokens generated, by agent.",
                              ["agent"], registry=registry)
        self.episodes = Counter("flexmarl_rolloutd_episodes_total", "Episodes finished.", registry=registry)
        self.episodes_failed = Counter("flexmarl_rolloutd_episodes_failed_total",
                                       "Episodes dropped because their reward failed (raised, timed out, gave no "
                                       "finite number).", registry=registry)
        self.engine_restarts = Counter("flexmarl_rolloutd_engine_restarts_total",
                                       "Launched engine replicas relaunched after their process exited.",
                                       registry=registry)
        self.engine_hung = Counter("flexmarl_rolloutd_engine_hung_total",
                                   "Engine replicas dropped as hung (requests held, none answered for half the "
                                   "progress bound).", registry=registry)
        self.engine_gave_up = Counter("flexmarl_rolloutd_engine_gave_up_total",
                                      "Launched engine replicas given up after too many restarts.", registry=registry)
        self.tasks = Counter("flexmarl_rolloutd_tasks_total", "Rollout tasks finished, by outcome.", ["outcome"],
                             registry=registry)
        self.task_seconds = Histogram("flexmarl_rolloutd_task_seconds", "Wall time of one rollout task (a group).",
                                      buckets=_TASK_BUCKETS_S, registry=registry)
        self.reload_seconds = Histogram("flexmarl_rolloutd_weight_reload_seconds",
                                        "Time to load new weights onto a replica.", ["agent"],
                                        buckets=_TASK_BUCKETS_S, registry=registry)
        self.sync_phase_seconds = Histogram(
            "flexmarl_rolloutd_weight_sync_phase_seconds",
            "One version received over a weight-update group, by phase: plan (rank 0's plan, joining), begin, "
            "transfer (every bucket received and loaded), end, verify (/model_info).", ["agent", "phase"],
            buckets=_TASK_BUCKETS_S, registry=registry)
        self.backpressure = Gauge("flexmarl_rolloutd_backpressure",
                                  "1 while no new task is leased because stored is full, down or slow.",
                                  registry=registry)
        self.backpressure_seconds = Counter("flexmarl_rolloutd_backpressure_seconds_total",
                                            "Time the lease loop held back because stored pushed back.",
                                            registry=registry)
        self.engines_preparing = Gauge("flexmarl_rolloutd_engines_preparing",
                                       "Jobs whose engines (launch or attach, LoRA flags, router, weight groups), "
                                       "environment and runner are being prepared.", registry=registry)
        self.max_tasks = Gauge("flexmarl_rolloutd_max_tasks",
                               "Rollout tasks leased at most at once (--max-tasks; auto: sized from the served jobs' "
                               "staleness rules and the live rolloutds).", registry=registry)
        self.pending_appends = Gauge("flexmarl_rolloutd_pending_appends",
                                     "Finished tasks whose experiences are not yet durable in stored.",
                                     registry=registry)
        self.append_retries = Counter("flexmarl_rolloutd_append_retries_total",
                                      "Appends to stored retried, by status code.", ["code"], registry=registry)
        self.dataset_rows_skipped = Counter("flexmarl_rolloutd_dataset_rows_skipped_total",
                                            "Malformed rows of jobs' task files left out when a job was set up "
                                            "(each also logged), by split.", ["split"], registry=registry)

        self._registry = registry

    def watch_router(self, router: Callable[[], Any]) -> None:
        """Exports replica load and balancer state, read from the router at scrape time."""
        self._registry.register(_RouterCollector(router))

    def observe_task(self, result: RolloutResult, seconds: float) -> None:
        """Records one successful task."""
        self.tasks.labels("ok").inc()
        self.task_seconds.observe(seconds)
        self.episodes.inc(len(result.returns))
        for experience in result.experiences:
            self.tokens.labels(experience.agent).inc(experience.response_tokens)

    def observe_reload(self, agent: str, seconds: float) -> None:
        """Records one weight load."""
        self.reload_seconds.labels(agent.rsplit("/", 1)[-1]).observe(seconds)

    def observe_broadcast(self, agent: str, outcome: SyncOutcome) -> None:
        """Records the phases of one version received over a weight-update group."""
        name = agent.rsplit("/", 1)[-1]
        for phase, seconds in outcome.phases.items():
            self.sync_phase_seconds.labels(name, phase).observe(seconds)


class _RouterCollector(Collector):
    """Per replica: queue depth, in-flight requests, rate; per agent: replicas, drain cost; moves, load cost."""

    def __init__(self, router: Callable[[], Any]) -> None:
        self._router = router

    def collect(self) -> Iterator[GaugeMetricFamily]:
        outstanding = GaugeMetricFamily("flexmarl_rolloutd_replica_outstanding_tokens",
                                        "Estimated tokens queued or running on a replica.", labels=["replica"])
        in_flight = GaugeMetricFamily("flexmarl_rolloutd_replica_in_flight_requests",
                                      "Requests running on a replica.", labels=["replica"])
        queued = GaugeMetricFamily("flexmarl_rolloutd_queued_requests",
                                   "Requests waiting for a replica of their agent.", labels=["agent"])
        replicas = GaugeMetricFamily("flexmarl_rolloutd_agent_replicas", "Replicas serving (or moving to) an agent.",
                                     labels=["agent"])
        moves = GaugeMetricFamily("flexmarl_rolloutd_balancer_reassignments",
                                  "Inter-agent replica reassignments so far.")
        rates = GaugeMetricFamily("flexmarl_rolloutd_replica_tokens_per_s",
                                  "Tokens/s the balancer counts for a replica: the replicas' measured capacity "
                                  "(the best delivered rate among them; the prior until measured).", labels=["replica"])
        delivered = GaugeMetricFamily("flexmarl_rolloutd_replica_delivered_tokens_per_s",
                                      "Tokens a replica delivered per second busy generating, measured (a moving "
                                      "average; the prior until measured).", labels=["replica"])
        reload_cost = GaugeMetricFamily("flexmarl_rolloutd_balancer_reload_seconds",
                                        "Seconds of one weight load a replica move pays in the balancer's estimate: "
                                        "the measured loads' average (the configured prior until one).")
        drain = GaugeMetricFamily("flexmarl_rolloutd_balancer_drain_seconds",
                                  "Seconds a replica with requests in flight is counted to drain when it leaves an "
                                  "agent's group: the measured drains' average, or the longest under way if longer "
                                  "(0: none yet).", labels=["agent"])
        router = self._router()
        balancer = router.balancer() if router is not None else None
        if balancer is not None:
            for view in balancer.replicas():
                outstanding.add_metric([view.replica_id], view.outstanding_tokens)
                in_flight.add_metric([view.replica_id], view.in_flight_requests)
                rates.add_metric([view.replica_id], view.tokens_per_s)
                delivered.add_metric([view.replica_id], router.delivered_tokens_per_s(view.replica_id))
            waiting: dict[str, int] = {}
            for ticket in balancer.queued():
                waiting[ticket.agent] = waiting.get(ticket.agent, 0) + 1
            for agent, count in balancer.replica_counts().items():
                replicas.add_metric([agent], count)
                queued.add_metric([agent], waiting.get(agent, 0))
                drain.add_metric([agent], balancer.drain_estimate_s(agent))
            moves.add_metric([], balancer.reassignments)
            reload_cost.add_metric([], balancer.reassignment_cost_s)
        yield from (outstanding, in_flight, queued, replicas, moves, rates, delivered, reload_cost, drain)
