"""Tokens per episode of each agent, for the rollout demand rolloutd's balancer shares replicas by."""

from __future__ import annotations

from orchestratord.binding import AgentKey


class RolloutDemandEstimator:
    """Outstanding estimated generation tokens per agent, for rolloutd's inter-agent balancer.

    Tokens per episode of an agent are an exponential moving average over
    reported tasks, starting from the prior (its ``max_new_tokens``): demand =
    episodes still to generate x that estimate.
    """

    def __init__(self, smoothing: float = 0.2) -> None:
        self._smoothing = smoothing
        self._tokens_per_episode: dict[AgentKey, float] = {}

    def set_prior(self, agent: AgentKey, tokens_per_episode: float) -> None:
        """Starting estimate for an agent (kept if one exists)."""
        self._tokens_per_episode.setdefault(agent, float(tokens_per_episode))

    def observe(self, agent: AgentKey, episodes: int, response_tokens: int) -> None:
        """Folds in a finished task's tokens."""
        if episodes <= 0:
            return
        sample = response_tokens / episodes
        previous = self._tokens_per_episode.get(agent)
        self._tokens_per_episode[agent] = sample if previous is None else (
            (1.0 - self._smoothing) * previous + self._smoothing * sample)

    def tokens_per_episode(self, agent: AgentKey) -> float:
        """Current estimate (0 when unknown)."""
        return self._tokens_per_episode.get(agent, 0.0)

    def estimate(self, agent: AgentKey, outstanding_episodes: int) -> int:
        """Estimated tokens still to generate for ``outstanding_episodes`` episodes."""
        return int(round(outstanding_episodes * self.tokens_per_episode(agent)))

    def forget_job(self, job_id: str) -> None:
        """Drops a finished job's estimates."""
        for key in [key for key in self._tokens_per_episode if key[0] == job_id]:
            del self._tokens_per_episode[key]
