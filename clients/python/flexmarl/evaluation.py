"""Held-out evaluation results: one episode's outcome, and a round's metrics per agent and for the team.

rolloutd plays a round's held-out episodes (``evaluation:`` in the job spec, docs/evaluation.md) and
reports an :class:`EvalEpisode` for each; orchestratord aggregates a round's episodes with
:func:`aggregate` into an :class:`EvalRecord`, which it stores in the job's history (keyed by the
round's version) and hands to the trackers; the SDK reads the records back (``Client.evaluations``).

Metrics of a scope (an agent, or the team), over the round's episodes:

* ``reward_mean``: the mean episode return (the team's: the mean over its agents' returns).
* ``success``: the fraction of episodes that succeeded (pass@1 when there is one sample per task).
  An agent succeeds when its return is >= ``evaluation.success_threshold``; the team when the
  environment's ``ctx.notes["success"]`` is true, or, in an episode without that note, when every
  agent succeeded.
* ``pass_at_k``: the fraction of tasks with at least one successful episode among their k
  (``evaluation.samples_per_task``) samples.

Per workflow role (a ready-made workflow leaves ``ctx.notes["role_correct"]``, role -> the share of
that role's outputs that were correct): ``role_correct``, the mean over the episodes that name the role.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: The note an environment sets (``ctx.notes["success"] = True``) to say whether the team succeeded.
SUCCESS_NOTE = "success"
#: The note a ready-made workflow sets: role -> the share of the role's outputs that were correct.
ROLE_CORRECT_NOTE = "role_correct"


@dataclasses.dataclass(frozen=True)
class EvalEpisode:
    """One held-out episode as rolloutd plays it (no experience is ever made of it)."""

    task_index: int
    sample_index: int
    #: Each agent's episode return (the unshaped sum of its rewards).
    returns: Mapping[str, float]
    #: The environment's ``ctx.notes["success"]`` as a bool; None when the episode did not set it.
    team_success: bool | None
    #: The policy versions that generated each agent's turns (every token's), ascending.
    versions: Mapping[str, tuple[int, ...]]
    #: A workflow's ``ctx.notes["role_correct"]`` (role -> share correct in [0, 1]); empty otherwise.
    role_correct: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class EvalScores:
    """Metrics of one scope (an agent or the team) over a round."""

    reward_mean: float
    success: float
    pass_at_k: float
    episodes: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class EvalAgentScores:
    """An agent's metrics over a round, with the version the round asked for and the versions that answered."""

    agent: str
    #: The agent's committed version when the round was created (the least its episodes were played with).
    version: int
    #: Every version that generated a turn of the agent in the round (engines may move on while it runs).
    versions_seen: tuple[int, ...]
    scores: EvalScores


@dataclasses.dataclass(frozen=True)
class EvalRecord:
    """One evaluation round: what the job's history keeps under the round's version."""

    #: The team's version the round evaluates (the lowest committed version over the agents when it was created).
    version: int
    tasks: int
    samples_per_task: int
    #: Tasks given up after too many failed attempts (their episodes are not in the metrics).
    failed_tasks: int
    sampling: str
    team: EvalScores
    agents: tuple[EvalAgentScores, ...]
    #: Whether some episode's team success came from the environment's ``ctx.notes["success"]``.
    team_success_from_env: bool
    finished_unix_ms: int = 0
    #: ``v<version>`` for a round opened at a version, ``d<n>`` for one asked for (``flexmarl eval``).
    round_id: str = ""
    #: The task file an on-demand round's rows came from (``flexmarl eval --dataset``); "": the job's held-out tasks.
    eval_file: str = ""
    #: Per workflow role: the mean share of correct outputs over the episodes that name the role.
    role_correct: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def on_demand(self) -> bool:
        """Whether the round was asked for, on versions chosen by the asker."""
        return self.round_id.startswith("d")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (what etcd stores)."""
        return {
            "version": self.version, "tasks": self.tasks, "samples_per_task": self.samples_per_task,
            "failed_tasks": self.failed_tasks, "sampling": self.sampling, "team": self.team.as_dict(),
            "agents": [{"agent": a.agent, "version": a.version, "versions_seen": list(a.versions_seen),
                        "scores": a.scores.as_dict()} for a in self.agents],
            "team_success_from_env": self.team_success_from_env, "finished_unix_ms": self.finished_unix_ms,
            "round_id": self.round_id, "eval_file": self.eval_file, "role_correct": dict(self.role_correct),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalRecord:
        """Decodes :meth:`as_dict`."""
        return cls(
            version=int(data["version"]), tasks=int(data["tasks"]), samples_per_task=int(data["samples_per_task"]),
            failed_tasks=int(data["failed_tasks"]), sampling=str(data["sampling"]),
            team=EvalScores(**data["team"]),
            agents=tuple(EvalAgentScores(str(a["agent"]), int(a["version"]),
                                         tuple(int(v) for v in a["versions_seen"]), EvalScores(**a["scores"]))
                         for a in data["agents"]),
            team_success_from_env=bool(data["team_success_from_env"]),
            finished_unix_ms=int(data.get("finished_unix_ms", 0)), round_id=str(data.get("round_id", "")),
            eval_file=str(data.get("eval_file", "")),
            role_correct={str(k): float(v) for k, v in dict(data.get("role_correct", {})).items()},
        )

    def scores_of(self, agent: str) -> EvalScores:
        """One agent's metrics; raises KeyError for an agent the round did not evaluate."""
        for entry in self.agents:
            if entry.agent == agent:
                return entry.scores
        raise KeyError(agent)


def _scores(successes_by_task: Mapping[int, list[bool]], rewards: Sequence[float]) -> EvalScores:
    episodes = len(rewards)
    if episodes == 0:
        return EvalScores(0.0, 0.0, 0.0, 0)
    flags = [flag for flags in successes_by_task.values() for flag in flags]
    passed = sum(1 for flags in successes_by_task.values() if any(flags))
    return EvalScores(reward_mean=math.fsum(rewards) / episodes, success=sum(flags) / len(flags),
                      pass_at_k=passed / len(successes_by_task), episodes=episodes)


def aggregate(episodes: Iterable[EvalEpisode], *, agents: Sequence[str], agent_versions: Mapping[str, int],
              version: int, tasks: int, samples_per_task: int, failed_tasks: int, sampling: str,
              success_threshold: float, finished_unix_ms: int = 0, round_id: str = "") -> EvalRecord:
    """A round's :class:`EvalRecord` from its episodes (see the module doc for the metrics)."""
    episodes = sorted(episodes, key=lambda e: (e.task_index, e.sample_index))
    agent_success: dict[str, dict[int, list[bool]]] = {a: defaultdict(list) for a in agents}
    agent_rewards: dict[str, list[float]] = {a: [] for a in agents}
    seen: dict[str, set[int]] = {a: set() for a in agents}
    team_success: dict[int, list[bool]] = defaultdict(list)
    team_rewards: list[float] = []
    roles: dict[str, list[float]] = defaultdict(list)
    from_env = False
    for episode in episodes:
        succeeded = {}
        for agent in agents:
            value = float(episode.returns.get(agent, 0.0))
            succeeded[agent] = value >= success_threshold
            agent_rewards[agent].append(value)
            agent_success[agent][episode.task_index].append(succeeded[agent])
            seen[agent].update(episode.versions.get(agent, ()))
        team_rewards.append(math.fsum(agent_rewards[a][-1] for a in agents) / len(agents) if agents else 0.0)
        for role, share in episode.role_correct.items():
            roles[role].append(float(share))
        from_env = from_env or episode.team_success is not None
        team = episode.team_success if episode.team_success is not None else all(succeeded.values())
        team_success[episode.task_index].append(team)
    return EvalRecord(
        version=version, tasks=tasks, samples_per_task=samples_per_task, failed_tasks=failed_tasks,
        sampling=sampling, team=_scores(team_success, team_rewards),
        agents=tuple(EvalAgentScores(a, int(agent_versions.get(a, version)), tuple(sorted(seen[a])),
                                     _scores(agent_success[a], agent_rewards[a])) for a in agents),
        team_success_from_env=from_env, finished_unix_ms=finished_unix_ms, round_id=round_id,
        role_correct={role: math.fsum(shares) / len(shares) for role, shares in sorted(roles.items())},
    )


#: The columns of one evaluation row (``flexmarl history --eval``): a round's scope (an agent or the team).
EVAL_ROW_FIELDS = ("round", "version", "scope", "agent_version", "versions_seen", "reward_mean", "success",
                   "pass_at_k", "episodes", "tasks", "samples_per_task", "failed_tasks", "sampling", "role_correct")


def eval_rows(records: Iterable[EvalRecord], team: str = "team") -> list[dict[str, Any]]:
    """One flat row per round and scope (each agent, then the team): periodic rounds by version, then on-demand ones."""
    rows: list[dict[str, Any]] = []
    for record in sorted(records, key=lambda r: (r.on_demand, r.version, r.round_id)):
        common = {"tasks": record.tasks, "samples_per_task": record.samples_per_task,
                  "failed_tasks": record.failed_tasks, "sampling": record.sampling}
        scopes = [(a.agent, str(a.version), " ".join(map(str, a.versions_seen)), a.scores) for a in record.agents]
        seen = sorted({v for a in record.agents for v in a.versions_seen})
        scopes.append((team, "", " ".join(map(str, seen)), record.team))
        roles = " ".join(f"{role}={share:.3f}" for role, share in sorted(record.role_correct.items()))
        for scope, agent_version, versions_seen, scores in scopes:
            rows.append({"round": record.round_id, "version": record.version, "scope": scope,
                         "agent_version": agent_version,
                         "versions_seen": versions_seen, "reward_mean": scores.reward_mean,
                         "success": scores.success, "pass_at_k": scores.pass_at_k, "episodes": scores.episodes,
                         **common, "role_correct": roles if scope == team and not agent_version else ""})
    return rows


def role_correct_note(notes: Mapping[str, Any]) -> dict[str, float]:
    """The episode's ``ctx.notes["role_correct"]`` as role -> share (numbers only; {} without the note)."""
    value = notes.get(ROLE_CORRECT_NOTE)
    if not isinstance(value, Mapping):
        return {}
    return {str(role): float(share) for role, share in value.items()
            if isinstance(share, int | float) and not isinstance(share, bool)}


def team_success_note(notes: Mapping[str, Any]) -> bool | None:
    """The episode's ``ctx.notes["success"]`` as a bool, or None when it has none."""
    if SUCCESS_NOTE not in notes:
        return None
    return bool(notes[SUCCESS_NOTE])
