"""Episodes whose reward failed and tasks given up, counted per step and over a job (docs/workflows.md).

A step's :class:`FailureFigures` are those of the tasks of its rollout batch (``pipeline.step_fill:
batch``) or, under ``completion``, of the tasks reported while it was the step being filled. They
are bounded whatever fails: two counts and the first and last reasons, each cut to
:data:`MAX_REASON_CHARS`. Each committed step's history record carries them
(:meth:`FailureFigures.as_record`); the job's totals over the steps every agent committed are
durable beside the commit that completed the step (``StateStore.commit_step``'s
``failure_totals``), so ``flexmarl status`` shows the same totals after an orchestratord restart.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

#: A reason kept in a step's figures is cut to this many characters (the history record stays small).
MAX_REASON_CHARS = 300

#: The history record's keys of a step's figures; a record written before they existed has none of them.
RECORD_KEYS = ("episodes_failed", "tasks_given_up", "first_failure", "last_failure")


def _cut(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS - 3] + "..."


@dataclasses.dataclass(frozen=True)
class FailureFigures:
    """Episodes dropped as their reward failed and tasks given up, with the first and the last reason."""

    episodes_failed: int = 0
    tasks_given_up: int = 0
    #: "task <id> episode <i>: <reason>" or "task <id> given up: <reason>", cut to MAX_REASON_CHARS.
    first_failure: str = ""
    last_failure: str = ""

    def __bool__(self) -> bool:
        return bool(self.episodes_failed or self.tasks_given_up)

    def add(self, reason: str, episodes: int = 0, tasks: int = 0) -> FailureFigures:
        """These figures with ``episodes`` more dropped and ``tasks`` more given up, ``reason`` the latest."""
        reason = _cut(reason)
        return FailureFigures(self.episodes_failed + episodes, self.tasks_given_up + tasks,
                              self.first_failure or reason, reason)

    def plus(self, later: FailureFigures) -> FailureFigures:
        """These figures followed by ``later``'s (the first reason is this one's, the last ``later``'s)."""
        return FailureFigures(self.episodes_failed + later.episodes_failed, self.tasks_given_up + later.tasks_given_up,
                              self.first_failure or later.first_failure, later.last_failure or self.last_failure)

    def as_record(self) -> dict[str, Any]:
        """The history record's fields (:data:`RECORD_KEYS`)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Stable JSON encoding."""
        return json.dumps(self.as_record(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> FailureFigures | None:
        """Decodes :meth:`as_record` (or :meth:`to_json`'s object); None for a record without the fields."""
        if "episodes_failed" not in record:
            return None
        return cls(int(record["episodes_failed"]), int(record.get("tasks_given_up", 0)),
                   str(record.get("first_failure", "")), str(record.get("last_failure", "")))

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureFigures:
        """Decodes :meth:`to_json`."""
        return cls.from_record(json.loads(text)) or cls()
