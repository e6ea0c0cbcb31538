"""Prometheus metrics of rolloutd (registered into the daemon's own registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from flexmarl.metrics import LATENCY_BUCKETS_S
from rolloutd.runner import RolloutResult

_TASK_BUCKETS_S = (*LATENCY_BUCKETS_S, 30.0, 60.0, 120.0, 300.0)


class RolloutMetrics:
    """Tokens, tasks, episode latency, weight reloads."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.tokens = Counter("flexmarl_rolloutd_generated_tokens_total", "Response tokens generated, by agent.",
                              ["agent"], registry=registry)
        self.episodes = Counter("flexmarl_rolloutd_episodes_total", "Episodes finished.", registry=registry)
        self.tasks = Counter("flexmarl_rolloutd_tasks_total", "Rollout tasks finished, by outcome.", ["outcome"],
                             registry=registry)
        self.task_seconds = Histogram("flexmarl_rolloutd_task_seconds", "Wall time of one rollout task (a group).",
                                      buckets=_TASK_BUCKETS_S, registry=registry)
        self.reload_seconds = Histogram("flexmarl_rolloutd_weight_reload_seconds",
                                        "Time to load new weights onto a replica.", ["agent"],
                                        buckets=_TASK_BUCKETS_S, registry=registry)

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
