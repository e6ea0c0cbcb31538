"""Where a kept run's step goes: each agent's trainer busy, waiting for its next micro-batch, or otherwise idle.

    python -m benchmarks.trainer_waits RUN_DIR [RUN_DIR ...]     # --keep directories' runs (read only)

For every agent and step after step 0 (modelled seconds, means per step), from one run directory of
``benchmarks.time_to_reward --keep`` or ``benchmarks.run``:

* **commit to commit**: the agent's step t commit less its step t - 1 commit (history.json);
* **busy**: the agent's trainer device work of step t (its ``traind-*-<agent>`` traces: the micro-batches'
  forward + backward and the optimizer step, exactly what ``traind/pacing.py`` charged);
* **waiting for its next micro-batch**: before each micro-batch's work, the time from the end of the
  trainer's previous work (or the previous commit) until that micro-batch's experiences were all in
  stored (the experiences' ``created_unix_ms`` in ``stored-data/stored.db``, opened read-only; a step's
  experiences in write order, a micro-batch's share each): the rollout had not delivered it yet;
* **other**: the rest: the micro-batch was there but the trainer was not working on it (the agent off
  its slot while another agent trained there, a state swap, the poll, the commit and its publish).

And per engine replica: its busy share of the same window and the modelled tokens it generated per busy
modelled second, with the batch that rate means when decode is weight-bound
(``tokens per s x weight-read seconds per iteration``: a replica decoding a few sequences at a time reads
the weights once per iteration for each of them; at full batching it is hundreds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sqlite3
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import Column, render_table
from benchmarks.reward_versions import stored_db
from flexmarl import devicemodel
from flexmarl.ids import StepRef


@dataclasses.dataclass(frozen=True)
class StepSplit:
    """One agent's step t, split (wall seconds)."""

    span_s: float  # commit of t - 1 to commit of t
    busy_s: float
    wait_data_s: float

    @property
    def other_s(self) -> float:
        """The rest of the span."""
        return self.span_s - self.busy_s - self.wait_data_s


def split_step(
    previous_commit_s: float, commit_s: float, work: Sequence[dict[str, Any]], ready_s: Sequence[float]
) -> StepSplit:
    """Splits one step: ``work`` its trace records in order (the micro-batches' ``train``, then ``optimizer``),
    ``ready_s`` when each micro-batch's experiences were all written, in the order they trained."""
    trains = [r for r in work if r["kind"] == "train"]
    if len(ready_s) != len(trains):
        raise ValueError(f"{len(trains)} micro-batches trained, {len(ready_s)} ready times")
    cursor, wait = previous_commit_s, 0.0
    for record, ready in zip(trains, ready_s, strict=True):
        wait += max(0.0, min(ready, record["start_s"]) - cursor)
        cursor = max(cursor, record["end_s"])
    busy = sum(r["end_s"] - r["start_s"] for r in work)
    return StepSplit(commit_s - previous_commit_s, busy, wait)


def steps_of(records: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A trainer's trace records cut into steps (each ends with its optimizer step)."""
    steps: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for record in sorted(records, key=lambda r: r["start_s"]):
        current.append(record)
        if record["kind"] == "optimizer":
            steps.append(current)
            current = []
    return steps


def micro_batch_ready(written_s: Sequence[float], micro_batches: int) -> list[float]:
    """When each of a step's ``micro_batches`` was complete, its experiences ``written_s`` taken in write order
    (completion fill: a step's micro-batches are its groups in the order their tasks finished)."""
    if micro_batches <= 0 or len(written_s) % micro_batches:
        raise ValueError(f"{len(written_s)} experiences do not split into {micro_batches} micro-batches")
    per = len(written_s) // micro_batches
    ordered = sorted(written_s)
    return [ordered[per * (index + 1) - 1] for index in range(micro_batches)]


def step_writes(run_dir: Path) -> dict[tuple[str, int], list[float]]:
    """(agent, step) -> the wall seconds stored received each experience that step trained on."""
    out: dict[tuple[str, int], list[float]] = {}
    with sqlite3.connect(f"file:{stored_db(run_dir)}?mode=ro", uri=True) as db:
        for agent, step_id, created_ms in db.execute(
                "SELECT agent, step_id, created_unix_ms FROM experiences WHERE step_id != ''"):
            out.setdefault((agent, StepRef.parse(step_id).step), []).append(created_ms / 1000.0)
    return out


def analyse(run_dir: Path) -> dict[str, Any]:
    """One run's per-agent split (modelled seconds per step, steps 1 onwards) and its engines' figures."""
    profile = devicemodel.load_profile(run_dir / "device.json")
    scale = profile.time_scale
    history = json.loads((run_dir / "history.json").read_text())
    commits = {(r["agent"], r["step"]): r["committed_unix_ms"] / 1000.0 for r in history}
    traces = devicemodel.read_traces(run_dir / "traces")
    writes = step_writes(run_dir)
    agents: dict[str, dict[str, float]] = {}
    for agent in sorted({r["agent"] for r in history}):
        records = [r for who, rs in traces.items() if who.startswith("traind-") and who.endswith(f"-{agent}")
                   for r in rs]
        steps = steps_of(records)
        splits = [
            split_step(commits[(agent, t - 1)], commits[(agent, t)], steps[t],
                       micro_batch_ready(writes[(agent, t)], sum(r["kind"] == "train" for r in steps[t])))
            for t in range(1, len(steps)) if (agent, t) in commits
        ]
        agents[agent] = {
            "commit_to_commit_s": statistics.fmean(s.span_s for s in splits) / scale,
            "busy_s": statistics.fmean(s.busy_s for s in splits) / scale,
            "waiting_for_micro_batch_s": statistics.fmean(s.wait_data_s for s in splits) / scale,
            "other_s": statistics.fmean(s.other_s for s in splits) / scale,
        }
    start = min(t for (_, step), t in commits.items() if step == 0)
    end = max(commits.values())
    weight_read_s = profile.weight_bytes / (
        profile.hbm_bytes_per_s * profile.hbm_efficiency * profile.rollout_devices_per_replica)
    engines = {}
    for who, rs in sorted(traces.items()):
        if not who.startswith("engine-"):
            continue
        generated = [r for r in rs if r["kind"] == "generate" and start <= r["start_s"] < end]
        busy_modelled = sum(r["modelled_s"] for r in generated)
        rate = sum(r.get("tokens", 0.0) for r in generated) / busy_modelled if busy_modelled > 0 else 0.0
        engines[who] = {"busy_share": devicemodel.busy_seconds(rs, start, end) / (end - start),
                        "tokens_per_busy_s": rate, "weight_bound_batch": rate * weight_read_s}
    return {"run": str(run_dir), "steps": len({r["step"] for r in history}), "agents": agents, "engines": engines}


def report(result: dict[str, Any]) -> str:
    """The run's table: one row per agent, then the engines' means."""
    rows = [[agent, *figures.values()] for agent, figures in result["agents"].items()]
    columns = [Column("agent", 9, "<")] + [Column(name, len(name), ">", ".1f") for name in (
        "commit to commit s", "busy s", "waiting for its next micro-batch s", "other s")]
    engines = result["engines"].values()
    line = (f"engines (steps 1 on): busy {statistics.fmean(e['busy_share'] for e in engines):.1%}, "
            f"{statistics.fmean(e['tokens_per_busy_s'] for e in engines):.0f} modelled tokens per busy s, "
            f"a weight-bound batch of {statistics.fmean(e['weight_bound_batch'] for e in engines):.1f} sequences")
    table = "\n".join(render_table(columns, rows, sep="  "))
    return f"{result['run']} ({result['steps']} steps)\n{table}\n{line}"


def main(argv: list[str] | None = None) -> int:
    """Prints each run's table (``--json``: the figures)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="run directories (history.json, traces/, stored-data/)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for run in args.runs:
        missing = [name for name in ("device.json", "history.json", "traces") if not (run / name).exists()]
        if missing:  # benchmarks.run's --keep directories have no history.json: time_to_reward's --keep ones do
            parser.error(f"{run}: not a kept time_to_reward run directory (no {', '.join(missing)})")
    results = [analyse(run) for run in args.runs]
    print(json.dumps(results, indent=1) if args.json else "\n\n".join(report(r) for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
