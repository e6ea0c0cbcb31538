"""Durable progress of the held-out evaluation rounds still open: what an orchestratord restart finishes.

A round (``orchestratord.planner.evaluation``) is written when it opens (:class:`EvalRoundOpened`: its
id, versions, task count and settings) and each of its tasks when it reports or is given up
(:class:`EvalTaskFinished`: the task's episodes). After a restart the planner rebuilds every open
round from them (:class:`OpenEvalRound`): the finished tasks keep their episodes and are not played
again, the others are leased again; a round whose every task had finished is recorded at once. When
the round's record is written (``EvalRecorded``) its open-round keys are dropped.

Keys (relative to the configured prefix, beside orchestratord/state.py's)::

    jobs/<job>/eval_open/<round>/round           the round as opened (create-only)
    jobs/<job>/eval_open/<round>/tasks/<index>   a finished task: its episodes, or given up
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl.evaluation import EvalEpisode


@dataclasses.dataclass(frozen=True)
class EvalTaskResult:
    """A finished eval task of an open round: its episodes, or given up after too many attempts (``failed``)."""

    index: int
    failed: bool = False
    episodes: tuple[EvalEpisode, ...] = ()

    def to_json(self) -> str:
        """Stable JSON encoding."""
        return json.dumps({"index": self.index, "failed": self.failed,
                           "episodes": [_episode_dict(e) for e in self.episodes]},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> EvalTaskResult:
        """Decodes :meth:`to_json`."""
        data = json.loads(text)
        return cls(int(data["index"]), bool(data["failed"]), tuple(_episode(e) for e in data["episodes"]))


@dataclasses.dataclass(frozen=True)
class OpenEvalRound:
    """An evaluation round as it opened, and (when loaded) its tasks finished so far.

    ``agent_versions``: (agent, version, weights_uri) in the job's agent order; an on-demand round's
    older versions carry the weights their step recorded.
    """

    round_id: str
    version: int
    agent_versions: tuple[tuple[str, int, str], ...]
    tasks: int
    samples_per_task: int
    on_demand: bool = False
    eval_file: str = ""
    eval_sha256: str = ""
    #: ``greedy`` or ``policy``; "" (a round persisted before rounds carried it): the job's ``evaluation.sampling``.
    sampling: str = ""
    #: Loaded only: the tasks that reported or were given up, by index.
    finished: tuple[EvalTaskResult, ...] = ()

    def to_json(self) -> str:
        """Stable JSON encoding of the round as opened (never ``finished``: each task has its own key)."""
        data = dataclasses.asdict(dataclasses.replace(self, finished=()))
        del data["finished"]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, finished: Sequence[EvalTaskResult] = ()) -> OpenEvalRound:
        """Decodes :meth:`to_json`, with the round's finished tasks."""
        data = json.loads(text)
        data["agent_versions"] = tuple((str(a), int(v), str(w)) for a, v, w in data["agent_versions"])
        return cls(**data, finished=tuple(sorted(finished, key=lambda r: r.index)))


@dataclasses.dataclass(frozen=True)
class EvalRoundOpened:
    """A held-out evaluation round opened."""

    job_id: str
    opened: OpenEvalRound


@dataclasses.dataclass(frozen=True)
class EvalTaskFinished:
    """An eval task of an open round reported its episodes or was given up."""

    job_id: str
    round_id: str
    result: EvalTaskResult


def round_order(round_id: str) -> tuple[bool, int]:
    """The order rounds open in: periodic ones (``v<version>``) by version, then on-demand ones (``d<n>``)."""
    return round_id.startswith("d"), int(round_id[1:]) if round_id[1:].isdigit() else 0


def open_rounds(definitions: Mapping[str, str | bytes], results: Mapping[str, Sequence[EvalTaskResult]],
                recorded: frozenset[str]) -> tuple[OpenEvalRound, ...]:
    """The open rounds from their stored pieces, in :func:`round_order`.

    A round already recorded is left out: its keys outlived the record (a crash between writing the
    record and dropping them).
    """
    return tuple(OpenEvalRound.from_json(definitions[r], results.get(r, ()))
                 for r in sorted(definitions, key=round_order) if r not in recorded)


def _episode_dict(episode: EvalEpisode) -> dict[str, Any]:
    return {"task_index": episode.task_index, "sample_index": episode.sample_index,
            "returns": dict(episode.returns), "team_success": episode.team_success,
            "versions": {a: list(v) for a, v in episode.versions.items()},
            "role_correct": dict(episode.role_correct)}


def _episode(data: Mapping[str, Any]) -> EvalEpisode:
    success = data["team_success"]
    return EvalEpisode(
        task_index=int(data["task_index"]), sample_index=int(data["sample_index"]),
        returns={str(a): float(v) for a, v in data["returns"].items()},
        team_success=None if success is None else bool(success),
        versions={str(a): tuple(int(x) for x in v) for a, v in data["versions"].items()},
        role_correct={str(r): float(v) for r, v in data["role_correct"].items()})
