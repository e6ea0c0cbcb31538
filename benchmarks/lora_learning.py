"""Do 8 LoRA agents over one base learn? examples/signaling_lora/job.yaml on a local cluster (issue 17).

Usage (repo root)::

    python benchmarks/lora_learning.py [--steps 30] [--job examples/signaling_lora/job.yaml] [--seed 0]
        [--replicas 1] [--json-out benchmarks/results/lora_learning.json]

Starts a LocalCluster (etcd + the four daemons; one traind slot that holds the one base for all
agents, ``--replicas`` embedded engine replicas launched with the job's LoRA flags), submits the
job (four signaling pairs, every agent an adapter of one tiny Qwen2 base), waits for it, and
prints per step the mean reward over the agents (0/1 success of each pair: chance is 0.5 with
two objects) and its wall time. Agents served per replica is measured on the engines: every agent
is served by every replica of the base's pool (no replica moves, ``reassignments``), and the most
adapters one forward batch held (the embedded engine's ``max_batch_adapters``, the base counted).
Writes the table as JSON (``--json-out``). ``--seed s`` runs job seed s over base weights seed ``2s + 1``
(as benchmarks/lora_signaling_sim.py's seeds; 0 is the job file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO_ROOT))

import yaml  # noqa: E402

from flexmarl.cli import materialize_models  # noqa: E402
from flexmarl.client import Client  # noqa: E402
from flexmarl.localcluster import LocalCluster, LocalClusterConfig  # noqa: E402

DEFAULT_JOB = REPO_ROOT / "examples" / "signaling_lora" / "job.yaml"


def engine_states(run_dir: Path) -> list[dict[str, Any]]:
    """``/server_info`` internal state of every engine the cluster's rolloutd launched."""
    states = []
    for ready in sorted(run_dir.glob("rolloutd-*/engines/*.ready.json")):
        port = json.loads(ready.read_text())["port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as answer:
            states.append(json.loads(answer.read())["internal_states"][0])
    return states


def with_seed(raw: dict[str, Any], seed: int) -> dict[str, Any]:
    """The job with job seed ``seed`` and every ``tiny://...?seed=n`` model's weight seed shifted by ``2 * seed``."""
    def shifted(uri: str) -> str:
        head, sep, value = uri.rpartition("seed=")
        return f"{head}{sep}{int(value) + 2 * seed}" if uri.startswith("tiny://") and sep and value.isdigit() else uri

    agents = [{**a, **{k: shifted(a[k]) for k in ("base", "model") if k in a}} for a in raw["agents"]]
    return {**raw, "seed": seed, "agents": agents}


def run(job: Path, steps: int, replicas: int, timeout_s: float, seed: int = 0) -> dict[str, Any]:
    """Runs the job on a fresh local cluster; returns the per-step rewards and the engines' counts."""
    raw: dict[str, Any] = with_seed(yaml.safe_load(job.read_text()), seed)
    raw["total_steps"] = steps
    with tempfile.TemporaryDirectory(prefix="lora-learning-") as tmp:
        run_dir = Path(tmp)
        spec = materialize_models(raw, run_dir / "models")
        config = LocalClusterConfig(run_dir=run_dir / "cluster", engine_replicas=replicas, trainer_slots=1,
                                    etcd_prefix="/flexmarl-lora-learning", env={"PYTHONPATH": str(REPO_ROOT)})
        with LocalCluster(config) as cluster, \
                Client(etcd_endpoints=cluster.etcd_endpoint, etcd_prefix=config.etcd_prefix) as client:
            start = time.monotonic()
            job_id = client.submit(spec, job_id="signaling-lora")
            info = client.wait(job_id, timeout_s=timeout_s)
            wall_s = time.monotonic() - start
            history = client.history(job_id)
            engines = engine_states(run_dir / "cluster")
    per_step: dict[int, list[float]] = {}
    done_at: dict[int, int] = {}
    for record in history:
        per_step.setdefault(record.step, []).append(record.reward_mean)
        done_at[record.step] = max(done_at.get(record.step, 0), record.committed_unix_ms)
    first_ms = min(done_at.values()) if done_at else 0
    rows = [{"step": s, "reward_mean": statistics.fmean(r), "reward_min": min(r), "agents": len(r),
             "committed_s": (done_at[s] - first_ms) / 1000} for s, r in sorted(per_step.items())]
    return {"job": str(job), "seed": seed, "state": info.state.name, "agents": len(spec["agents"]), "steps": steps,
            "replicas": replicas, "wall_s": wall_s, "rows": rows,
            "max_batch_adapters": [e.get("max_batch_adapters") for e in engines]}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; prints the table; writes the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=DEFAULT_JOB)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--json-out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "lora_learning.json")
    args = parser.parse_args(argv)
    result = run(args.job, args.steps, args.replicas, args.timeout_s, args.seed)
    print(f"seed {result['seed']}: {result['agents']} LoRA agents, {result['replicas']} replica(s): "
          f"job {result['state']} in {result['wall_s']:.0f}s; "
          f"most adapters in one engine batch: {result['max_batch_adapters']}")
    print(f"{'step':>4} {'mean reward':>11} {'min agent':>9} {'t (s)':>7}")
    for row in result["rows"]:
        print(f"{row['step']:>4} {row['reward_mean']:>11.3f} {row['reward_min']:>9.3f} {row['committed_s']:>7.1f}")
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["state"] == "SUCCEEDED" else 1


if __name__ == "__main__":
    raise SystemExit(main())
