"""Reward on held-out tasks: a run's evaluation rounds as a curve against modelled time.

``benchmarks.time_to_reward --eval-every K`` gives every job an ``evaluation:`` section (docs/evaluation.md):
every K team versions, and at version 0, orchestratord opens a round of the same held-out tasks played greedily
on the agents' current weights. Issue 35 asks for time to "held-out success, once evaluation exists"; this is
that reading, beside the per-step and per-version readings of the training reward:

* a round's value is the team's ``success`` (the environment's ``ctx.notes["success"]``, else every agent's
  return at or above the job's ``success_threshold``) or its ``reward_mean`` (the mean over agents of their mean
  episode return), as the workload chooses: a 0/1 game succeeds or not, a graded reward (the long-tail share of
  even tokens) has no success worth the name;
* a round is placed at the modelled time the **newest** version that generated any of its turns was published
  (engines may move on while a round plays: ``versions_seen``), never earlier: no schedule is credited with a
  policy before it existed, and a round that saw newer weights than its opening named is placed at theirs;
* the moving mean is over ``WINDOW`` rounds (this and the one before): the tasks are the same every round and
  greedy, so a round has no sampling noise, but one version can still spike on its weights' fluctuation, as the
  training reward's per-version reading showed on arithmetic;
* on-demand rounds (``flexmarl eval``: the asker's versions, not the run's) are left out.

Under async a periodic round can take several versions to play (the share rule hands out one eval task at a time
while training tasks wait), so its point mixes versions and sits at the newest one's publish. ``--eval-after K``
reads the run on **pinned** rounds instead: the job keeps every K-th version (``checkpoint.keep_every``), and once
it has succeeded ``Client.evaluate_versions`` opens one on-demand round per kept team version v with every agent
pinned to its version v (``RolloutTask.pinned``: exactly those weights), at full width (no training task left to
share with). Each point then measures one team version, placed at the publish of the last agent's version v, and
the rounds cost the run's training nothing. ``eval_curve(..., pinned=True)`` reads those rounds (and only those).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl.evaluation import EvalRecord
from flexmarl.reward_time import HELDOUT_METRICS, heldout_curve

WINDOW = 2  # rounds in the moving mean the held-out target is read on
#: what a round's point measures (the team's scores of ``flexmarl.evaluation.EvalScores``)
METRICS = HELDOUT_METRICS


@dataclasses.dataclass(frozen=True)
class EvalPoint:
    """One evaluation round of a run."""

    modelled_s: float  # when the newest version that played in it was published
    version: int  # the team's version the round was opened at
    value: float  # the team's metric over the round's episodes
    window_reward: float  # mean of ``value`` over this round and the WINDOW - 1 before it (nan before)
    episodes: int


def eval_curve(records: Sequence[EvalRecord], published_s: Mapping[tuple[str, int], float],
               metric: str, pinned: bool = False) -> list[EvalPoint]:
    """The run's rounds in version order, each at its newest version's publish.

    Args:
        records: the job's evaluation records (``Client.evaluations``).
        published_s: (agent, version) -> modelled s the version was published (``reward_versions.published_times``).
        metric: one of ``METRICS``.
        pinned: read the on-demand rounds ``Client.evaluate_versions`` opened (every agent at the same version)
            instead of the periodic ones; the other kind is skipped.

    Raises:
        ValueError: an unknown metric, a round that names a version with no publish time, or a pinned round whose
            agents were asked different versions or played any other version than the one asked.
    """
    return [EvalPoint(p.seconds, p.version, p.value, p.window_reward, p.episodes)
            for p in heldout_curve(records, published_s, metric, WINDOW, pinned)]


def records_from_json(data: Sequence[Mapping[str, Any]]) -> list[EvalRecord]:
    """Evaluation records as a kept run wrote them (``EvalRecord.as_dict`` each)."""
    return [EvalRecord.from_dict(item) for item in data]


def team_versions_every(history: Sequence[Any], every: int) -> list[int]:
    """The team versions ``--eval-after`` pins a round to: 0, every multiple of ``every`` up to the team's final
    version (the lowest over the agents' last commits), and that final version (all kept: ``keep_every``).

    ``history``: the job's step records (``Client.history``: ``agent``, ``version``).
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    last: dict[str, int] = {}
    for record in history:
        last[record.agent] = max(last.get(record.agent, 0), int(record.version))
    final = min(last.values(), default=0)
    return sorted({*range(0, final + 1, every), final})
