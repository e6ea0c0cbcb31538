"""Time to reward: when a job's reward first reached a target, in seconds, and how several jobs compare.

What a user buys from an asynchronous pipeline is not a shorter step but a reward reached sooner; a step at
staleness 4 is not worth a step on-policy. ``flexmarl time-to-reward JOB [JOB ...]`` reads that from the jobs'
own records, two ways:

* **training** (the default): per step that every agent committed, the mean over the agents of the step's mean
  episode return (``StepRecord.return_mean``; the trained reward where a record has none), its moving mean over
  ``window`` steps (5), placed when the step's last agent committed it;
* **held-out** (``--eval``): the job's periodic evaluation rounds (``evaluation:``, docs/evaluation.md), the team's
  success (or its mean return, ``--metric reward_mean``), moving mean over 2 rounds, each round placed when the
  newest version that played in it was published (a round is never credited before its weights existed);
* **pinned** (``--pinned``): the on-demand rounds ``flexmarl eval --versions kept`` opened after the job, each with
  every agent at one team version, placed at that version's publish: each point measures one version, where a
  periodic round under async may mix several. Rounds not pinned to one team version are left out (and counted);
  of several rounds at one version the latest counts; rounds that played differently (sampling, samples, tasks,
  task file) are refused, as they are not one curve.

Times are seconds since the job was submitted and since its first step was committed ("after step 0": start-up,
warm starts and the first rollout left out, which is what the pipeline schedule changes). The target is the
user's (``--target``) or the first job's final moving mean minus 0.02, the rule issue 35's benchmarks use. With
several jobs each one's time after step 0 is also given as a speedup over the first job's.

``benchmarks.time_to_reward`` reads its runs with these same functions, on modelled rather than wall seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from flexmarl.evaluation import EvalRecord

#: Steps in the training reading's moving mean.
TRAINING_WINDOW = 5
#: Rounds in the held-out reading's moving mean (the same greedy tasks each round: little noise).
HELDOUT_WINDOW = 2
#: The default target: the first job's final moving mean minus this.
FINAL_TOLERANCE = 0.02
#: What a held-out round's point measures (``EvalScores`` of the team).
HELDOUT_METRICS = ("success", "reward_mean")

#: Maps a unix time in seconds to the reading's clock (seconds since the job's start, or modelled seconds).
Clock = Callable[[float], float]


@dataclasses.dataclass(frozen=True)
class RewardPoint:
    """One step every agent committed."""

    step: int
    seconds: float  # on the reading's clock, when the step's last agent committed it
    reward: float  # mean over the agents of the step's value
    window_reward: float  # mean of ``reward`` over this step and the window - 1 before it (nan before)


@dataclasses.dataclass(frozen=True)
class HeldOutPoint:
    """One evaluation round."""

    seconds: float  # when the newest version that played in it was published
    version: int  # the team version the round was opened at
    value: float  # the team's metric over the round's episodes
    window_reward: float  # mean of ``value`` over this round and the window - 1 before it (nan before)
    episodes: int


class Windowed(Protocol):
    """A point of a curve with a moving mean (``RewardPoint``, ``HeldOutPoint``, the benchmark's points)."""

    @property
    def window_reward(self) -> float:
        """The point's moving mean (nan before the window is full)."""
        ...


_P = TypeVar("_P", bound=Windowed)
_Q = TypeVar("_Q")


def _moving_mean(before: Sequence[_Q], value_of: Callable[[_Q], float], value: float, window: int) -> float:
    """The mean of ``value`` and the values of the ``window - 1`` points before it (nan while there are fewer)."""
    if window < 1 or len(before) < window - 1:
        return math.nan
    return statistics.fmean([*(value_of(p) for p in before[len(before) - (window - 1):]), value])


def _played_only(agent: Any, version: int) -> bool:
    """Whether an agent of a round was asked ``version`` and every turn of it was played by that version."""
    return bool(agent.version == version and set(agent.versions_seen) <= {version})


def episode_return(record: Any) -> float:
    """A step's reported reward: its mean unshaped episode return, the trained reward where it has none."""
    value = record.return_mean
    return float(record.reward_mean if value is None else value)


def training_curve(history: Sequence[Any], agents: int, clock: Clock, window: int = TRAINING_WINDOW,
                   value: Callable[[Any], float] = episode_return) -> list[RewardPoint]:
    """Per step all ``agents`` committed, in step order: the mean of ``value`` over them and its moving mean."""
    values: dict[int, list[float]] = {}
    done_at: dict[int, float] = {}
    for record in history:
        values.setdefault(record.step, []).append(value(record))
        done_at[record.step] = max(done_at.get(record.step, -math.inf), record.committed_unix_ms / 1000.0)
    points: list[RewardPoint] = []
    for step in sorted(step for step, found in values.items() if len(found) == agents):
        reward = statistics.fmean(values[step])
        smoothed = _moving_mean(points, lambda p: p.reward, reward, window)
        points.append(RewardPoint(step, clock(done_at[step]), reward, smoothed))
    return points


def published_seconds(history: Sequence[Any], clock: Clock) -> dict[tuple[str, int], float]:
    """(agent, version) -> when its commit published that version, on ``clock``; every agent's version 0 at 0."""
    out = {(r.agent, 0): 0.0 for r in history}
    out.update({(r.agent, r.version): clock(r.committed_unix_ms / 1000.0) for r in history})
    return out


def heldout_curve(records: Sequence[EvalRecord], published: Mapping[tuple[str, int], float], metric: str = "success",
                  window: int = HELDOUT_WINDOW, pinned: bool = False) -> list[HeldOutPoint]:
    """The job's rounds in version order, each at its newest version's publish (``published_seconds``).

    ``pinned``: read the on-demand rounds ``Client.evaluate_versions`` opened (every agent at the same version)
    instead of the periodic ones; the other kind is skipped.

    Raises:
        ValueError: an unknown metric, a round that names a version with no publish time, or a pinned round whose
            agents were asked different versions or played any other version than the one asked.
    """
    if metric not in HELDOUT_METRICS:
        raise ValueError(f"metric must be one of {HELDOUT_METRICS}, got {metric!r}")
    points: list[HeldOutPoint] = []
    for record in sorted((r for r in records if r.on_demand == pinned), key=lambda r: r.version):
        times = []
        for agent in record.agents:
            if pinned and not _played_only(agent, record.version):
                raise ValueError(f"round {record.round_id}: agent {agent.agent!r} asked version {agent.version}, "
                                 f"played {list(agent.versions_seen)}: not the team version {record.version} pinned")
            newest = max((agent.version, *agent.versions_seen))
            if (agent.agent, newest) not in published:
                raise ValueError(f"round {record.round_id or record.version}: agent {agent.agent!r} played "
                                 f"version {newest}, never published")
            times.append(published[(agent.agent, newest)])
        value = float(getattr(record.team, metric))
        smoothed = _moving_mean(points, lambda p: p.value, value, window)
        points.append(HeldOutPoint(max(times, default=0.0), record.version, value, smoothed, record.team.episodes))
    return points


def team_pinned_rounds(records: Sequence[EvalRecord]) -> tuple[list[EvalRecord], int]:
    """The on-demand rounds that pinned every agent to the round's team version (the latest per version), and the rest.

    The rest: how many on-demand rounds were left out as not pinned so (``flexmarl eval --agent-versions`` mixes, a
    round that played other versions).

    Raises:
        ValueError: the kept rounds played differently (sampling, samples per task, tasks or task file).
    """
    kept: dict[int, EvalRecord] = {}
    skipped = 0
    for record in sorted((r for r in records if r.on_demand), key=lambda r: int(r.round_id[1:] or 0)):
        if all(_played_only(agent, record.version) for agent in record.agents):
            kept[record.version] = record  # rounds in the order they were asked: the latest wins
        else:
            skipped += 1
    settings = {(r.sampling, r.samples_per_task, r.tasks, r.eval_file) for r in kept.values()}
    if len(settings) > 1:
        raise ValueError(f"the pinned rounds played differently (sampling, samples per task, tasks, task file: "
                         f"{sorted(settings)}); evaluate the versions again with one setting")
    return [kept[v] for v in sorted(kept)], skipped


def first_reaching(curve: Sequence[_P], target: float) -> _P | None:
    """The first point whose moving mean is >= target (None: never, or a nan target)."""
    if math.isnan(target):
        return None
    return next((p for p in curve if p.window_reward >= target), None)


def final_reward(curve: Sequence[Windowed]) -> float:
    """The last defined moving mean (nan: none)."""
    return next((p.window_reward for p in reversed(curve) if not math.isnan(p.window_reward)), math.nan)


# ---------------------------------------------------------------- the command


def add_parser(sub: argparse._SubParsersAction,  # type: ignore[type-arg]
               common: argparse.ArgumentParser) -> None:
    """Registers ``flexmarl time-to-reward`` on the CLI's subcommands."""
    p = sub.add_parser("time-to-reward", parents=[common],
                       help="seconds until each job's reward first reached a target, and how the jobs compare")
    p.add_argument("job_ids", nargs="+", metavar="JOB", help="the jobs (the first is the one the others are against)")
    p.add_argument("--target", type=float, default=None,
                   help=f"the reward to reach (default: the first job's final moving mean - {FINAL_TOLERANCE})")
    p.add_argument("--eval", action="store_true", help="read the periodic held-out rounds, not the training reward")
    p.add_argument("--pinned", action="store_true",
                   help="read the on-demand rounds of `flexmarl eval --versions kept` (one team version each)")
    p.add_argument("--metric", choices=HELDOUT_METRICS, default="success", help="with --eval: the team's figure")
    p.add_argument("--window", type=int, default=0,
                   help=f"steps (rounds) in the moving mean (0: {TRAINING_WINDOW}; with --eval {HELDOUT_WINDOW})")
    p.add_argument("--json", action="store_true", help="one JSON object: the target and every job's figures")
    p.set_defaults(func=cmd_time_to_reward)


def job_reading(history: Sequence[Any], evals: Sequence[EvalRecord], agents: int, submitted_s: float, *,
                heldout: bool, metric: str, window: int,
                pinned: bool = False) -> tuple[list[RewardPoint] | list[HeldOutPoint], float, int]:
    """One job's curve on seconds since it was submitted, when its first step was committed, and rounds left out.

    The first commit: nan when there is none; rounds left out: the on-demand rounds a pinned reading skipped.
    """
    def clock(unix_s: float) -> float:
        return unix_s - submitted_s

    steps = training_curve(history, agents, clock, window if not heldout else TRAINING_WINDOW)
    step0_s = steps[0].seconds if steps else math.nan
    if not heldout:
        return steps, step0_s, 0
    skipped = 0
    if pinned:
        evals, skipped = team_pinned_rounds(evals)
    return heldout_curve(evals, published_seconds(history, clock), metric, window, pinned), step0_s, skipped


def cmd_time_to_reward(args: argparse.Namespace) -> int:
    """Prints each job's time to the target (a table, or JSON) and its speedup over the first job."""
    from flexmarl import cli

    if args.window < 0 or (args.target is not None and not math.isfinite(args.target)):
        raise cli.CliError("--window must be >= 0 and --target a number", cli.EXIT_USAGE)
    if args.eval and args.pinned:
        raise cli.CliError("--eval (periodic rounds) and --pinned (on-demand rounds) are two readings: choose one",
                           cli.EXIT_USAGE)
    heldout = args.eval or args.pinned
    window = args.window or (HELDOUT_WINDOW if heldout else TRAINING_WINDOW)
    readings = []
    with cli._client(args) as client:
        for job_id in args.job_ids:
            info = client.status(job_id)
            history = client.history(job_id)
            evals = client.evaluations(job_id) if heldout else []
            try:
                curve, step0_s, skipped = job_reading(
                    history, evals, max(len(info.agents), 1), info.created_unix_ms / 1000.0, heldout=heldout,
                    metric=args.metric, window=window, pinned=args.pinned)
            except ValueError as exc:
                raise cli.CliError(f"job {job_id}: {exc}") from None
            readings.append((info, curve, step0_s, skipped))
    target = args.target
    if target is None:
        target = final_reward(readings[0][1]) - FINAL_TOLERANCE
    rows = [_row(info, curve, step0_s, target, heldout=heldout) for info, curve, step0_s, _ in readings]
    if args.pinned:
        for row, (*_, skipped) in zip(rows, readings, strict=True):
            row["rounds_left_out"] = skipped
    base = rows[0]["after_step0_s"]
    for row in rows:
        mine = row["after_step0_s"]
        row["speedup"] = base / mine if base is not None and mine else None
    kind = "pinned (one team version a round)" if args.pinned else "periodic"
    reading = (f"held-out team {args.metric} on {kind} rounds, moving mean of {window}" if heldout else
               f"mean episode return over the agents, moving mean of {window} steps")
    if args.json:
        json.dump({"reading": reading, "target": target, "jobs": rows}, sys.stdout, indent=2)
        print()
        return cli.EXIT_OK
    _print(rows, reading, target, heldout)
    for row in rows:
        if row.get("rounds_left_out"):
            print(f"job {row['job_id']}: {row['rounds_left_out']} on-demand rounds left out (not every agent at one "
                  "team version)", file=sys.stderr)
    return cli.EXIT_OK


def _row(info: Any, curve: Sequence[Any], step0_s: float, target: float, *, heldout: bool) -> dict[str, Any]:
    hit = first_reaching(curve, target)
    final = final_reward(curve)
    return {
        "job_id": info.job_id, "name": info.name, "state": info.state.name.lower(),
        "points": len(curve), "final": None if math.isnan(final) else final,
        "reached_at": None if hit is None else (hit.version if heldout else hit.step),
        "since_submit_s": None if hit is None else hit.seconds,
        "after_step0_s": None if hit is None or math.isnan(step0_s) else hit.seconds - step0_s,
    }


def _print(rows: Sequence[Mapping[str, Any]], reading: str, target: float, heldout: bool) -> None:
    from rich.table import Table

    from flexmarl import cli

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    table = Table("job", "state", "rounds" if heldout else "steps", "final", "reached at",
                  "s since submit", "s after step 0", "speedup")
    table.columns[0].overflow = "fold"  # a job id is what one copies: never cut
    for row in rows:
        reached = row["reached_at"]
        table.add_row(row["job_id"], row["state"], str(row["points"]), fmt(row["final"], ".3f"),
                      "-" if reached is None else f"{'version' if heldout else 'step'} {reached}",
                      fmt(row["since_submit_s"], ".0f"), fmt(row["after_step0_s"], ".0f"),
                      fmt(row["speedup"], ".2f") + ("x" if row["speedup"] is not None else ""))
    console = cli._console()
    console.print(f"{reading}; target {target:.3f}; speedup: over {rows[0]['job_id']}, after step 0", markup=False)
    console.print(table)
