"""Does a word-problem workflow job learn on held-out rows? An in-process warm start + GRPO run of a job over a dataset.

Runs the *real* ready-made workflow of the job (``flexmarl.workflows:SolverVerifier``, ``Debate``:
its prompts, turn order and reward functions) through the real :class:`rolloutd.runner.RolloutRunner`
against :class:`benchmarks.signaling_learning.BatchedBackend`, over the job's ``environment.dataset``
rows (train rows as the config's ``tasks``, eval rows as its ``eval_tasks``: the workflow's own
seeded shuffle per epoch, not the cluster's dataset order). Each agent warm-starts as traind does
(:func:`benchmarks.arithmetic_learning.warm_start`) and trains by GRPO with
:func:`benchmarks.signaling_learning.train_step`, strict on-policy. Held-out rounds are played by
:meth:`RolloutRunner.evaluate` on every eval row as the job's ``evaluation`` says (greedy: temperature 0,
here the argmax, one episode a row; ``sampling: policy``: ``samples_per_task`` episodes a row with the
agents' own sampling; ``--eval-samples`` overrides), before RL and every ``--eval-every`` steps:
success per agent (return >= 1), for the team (the workflow's ``success`` note) and, when rows have a
``held_out`` field, the team's per kind.

Usage (repo root)::

    python benchmarks/word_problems_learning.py --job examples/word_problems/job_solver_verifier.yaml --seeds 0
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from benchmarks.arithmetic_learning import adamw, warm_start  # noqa: E402
from benchmarks.signaling_learning import (  # noqa: E402
    _LOOP,
    SIM_JOB,
    AgentState,
    BatchedBackend,
    agent_algorithm,
    checkpoint,
    loss_settings,
    read_job,
    rollout_step,
    train_step,
)
from flexmarl.episode import load_environment  # noqa: E402
from rolloutd.runner import AgentRuntime, RolloutRunner, RolloutTaskInput  # noqa: E402
from rolloutd.tokenizers import HFTokenizer  # noqa: E402
from traind import losses, sft  # noqa: E402

logger = logging.getLogger(__name__)


class ArgmaxBackend(BatchedBackend):
    """BatchedBackend that answers a temperature-0 request with (numerically) the argmax token."""

    async def generate(self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int,
                       affinity_key: str) -> Any:
        """Temperature 0 becomes 1e-6: the softmax is one-hot on the argmax."""
        if float(sampling.get("temperature", 1.0)) <= 0.0:
            sampling = {**sampling, "temperature": 1e-6}
        return await super().generate(agent, input_ids, sampling, n, affinity_key)


def rows_of(path: Path) -> list[dict[str, Any]]:
    """The JSONL file's rows."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evaluate(runner: RolloutRunner, rows: Sequence[dict[str, Any]], seed: int, agents: Sequence[str],
             round_number: int, samples: int = 0) -> dict[str, float]:
    """One held-out round over every eval row: success per agent, team, team per ``held_out`` kind.

    ``samples``: 0 plays each row once greedily; k > 0 plays it k times with the agents' own sampling.
    """
    inputs = [RolloutTaskInput(SIM_JOB, f"{SIM_JOB}/e{round_number}/t{i}", i, seed, max(samples, 1))
              for i in range(len(rows))]

    async def play() -> list[Any]:
        return list(await asyncio.gather(*(runner.evaluate(t, greedy=samples == 0) for t in inputs)))

    results = _LOOP.run_until_complete(play())
    scores: dict[str, list[float]] = {}
    for row, res in zip(rows, results, strict=True):
        if not res.ok:
            raise RuntimeError(f"eval episode failed: {res.errors[0].message}")
        for episode in res.episodes:
            for agent in agents:
                scores.setdefault(agent, []).append(1.0 if episode.returns.get(agent, 0.0) >= 1.0 else 0.0)
            team = 1.0 if episode.team_success else 0.0
            scores.setdefault("team", []).append(team)
            if "held_out" in row:
                scores.setdefault(f"team:{row['held_out']}", []).append(team)
    return {k: statistics.fmean(v) for k, v in scores.items()}


def run_seed(spec: dict[str, Any], job_dir: Path, seed: int, steps: int, eval_every: int, cache_dir: Path,
             eval_samples: int = 0) -> dict[str, Any]:
    """Warm start, a held-out round, then ``steps`` GRPO steps with a round every ``eval_every``."""
    from transformers import AutoModelForCausalLM

    started, cpu_started = time.perf_counter(), time.process_time()
    dataset = spec["environment"]["dataset"]
    train_rows, eval_rows = rows_of(job_dir / dataset["train"]), rows_of(job_dir / dataset["eval"])
    config = {**spec["environment"].get("config", {}), "tasks": train_rows, "eval_tasks": eval_rows}
    env = load_environment(spec["environment"]["entrypoint"], config)
    batch = spec["batch"]
    torch.manual_seed(seed)
    states: dict[str, AgentState] = {}
    runtimes: dict[str, AgentRuntime] = {}
    sft_loss: dict[str, tuple[float, float]] = {}
    for index, agent in enumerate(spec["agents"]):
        name, opt = agent["name"], agent["optimizer"]
        path = checkpoint(cache_dir, agent["model"], 2 * seed + 1 + index)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        model.eval()  # type: ignore[no-untyped-call]
        eos = model.generation_config.eos_token_id
        eos_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        algo = agent_algorithm(spec, agent)
        loss_config, schedule = loss_settings(algo)
        state = AgentState(name, model, adamw(model, opt, float(opt["lr"])), float(opt.get("grad_clip", 1.0)),
                           eos_ids, loss_config, losses.AdvantageNorm(algo.get("advantage_norm", "std")),
                           losses.TurnBaseline(algo.get("turn_baseline", "episode")), schedule,
                           float(agent.get("sampling", {}).get("temperature", 1.0)))
        warm_spec = agent.get("warm_start")
        if warm_spec is not None:
            warm = sft.WarmStart(agent=name, dataset=warm_spec["dataset"], steps=int(warm_spec["steps"]),
                                 lr=float(warm_spec.get("lr", 1e-3)), batch_size=int(warm_spec.get("batch_size", 32)),
                                 seed=seed, config=tuple(sorted(warm_spec.get("config", {}).items())))
            key = hashlib.sha256(json.dumps([agent["model"], 2 * seed + 1 + index, warm_spec, seed,
                                              (job_dir / dataset["train"]).read_text()]).encode()).hexdigest()[:16]
            saved = cache_dir / f"warm-{name}-{key}.pt"
            if saved.exists():  # the same warm start, done before: its weights
                model.load_state_dict(torch.load(saved))
                sft_loss[name] = (math.nan, math.nan)
            else:
                state.optimizer = adamw(model, opt, warm.lr)
                step_losses = warm_start(state, warm, str(path))  # type: ignore[arg-type]
                sft_loss[name] = (step_losses[0], step_losses[-1])
                torch.save(model.state_dict(), saved)
            state.optimizer = adamw(model, opt, float(opt["lr"]))  # RL starts with a fresh optimizer, as traind's
        states[name] = state
        sampling = {k: v for k, v in agent.get("sampling", {}).items()
                    if k not in ("top_k", "top_p") or v not in (-1, 1.0)}
        if not sampling.get("stop_token_ids"):
            sampling.pop("stop_token_ids", None)
        runtimes[name] = AgentRuntime(HFTokenizer(str(path)), sampling)
    backend = ArgmaxBackend(states, torch.Generator().manual_seed(seed))
    runner = RolloutRunner(env, runtimes, backend, clock_ms=lambda: 0)
    agents = list(states)
    losses_text = " ".join(f"{a} {first:.3f}->{last:.3f}" for a, (first, last) in sft_loss.items())
    print(f"seed {seed}: warm start {losses_text} ({time.perf_counter() - started:.0f}s)", flush=True)
    curve: list[dict[str, Any]] = []

    def held_out_round(version: int) -> None:
        point = {"version": version, **evaluate(runner, eval_rows, seed, agents, version, eval_samples)}
        curve.append(point)
        print(f"seed {seed} EVAL v{version}: " + " ".join(f"{k}={v:.3f}" for k, v in point.items() if k != "version"),
              flush=True)

    held_out_round(0)
    trained: list[dict[str, Any]] = []
    for step in range(steps):
        t0 = time.perf_counter()
        results, records = rollout_step(runner, step, int(batch["prompts_per_step"]), seed, int(batch["group_size"]))
        episodes = [ret for res in results for ret in res.returns.values()]
        means = {a: statistics.fmean(e.get(a, 0.0) for e in episodes) for a in agents}
        for name, state in states.items():
            train_step(state, [r for r in records if r.agent == name], step)
        verdicts = [r for r in records if r.agent == "verifier"]
        if verdicts:  # the verifier's share of accepting verdicts ('y' first token)
            means["accepts"] = statistics.fmean(1.0 if list(r.response_token_ids[:1]) == [ord("y")] else 0.0
                                                for r in verdicts)
        trained.append({"step": step, **means})
        print(f"seed {seed} step {step:3d} " + " ".join(f"{a}={v:.3f}" for a, v in means.items())
              + f" {time.perf_counter() - t0:.2f}s", flush=True)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            held_out_round(step + 1)
    env_close = getattr(env, "aclose", None)
    if env_close is not None:
        _LOOP.run_until_complete(env_close())
    return {"seed": seed, "sft_loss": sft_loss, "curve": curve, "train": trained,
            "cpu_s": time.process_time() - cpu_started, "wall_s": time.perf_counter() - started}


def plot_run(run: dict[str, Any], out: Path, title: str) -> None:
    """Training reward per agent by step, and held-out success per agent, team and team per kind by version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(12, 4))
    agents = [k for k in run["train"][0] if k not in ("step", "accepts")]
    for agent in agents:
        ax_train.plot([r["step"] for r in run["train"]], [r[agent] for r in run["train"]], marker=".", label=agent)
    ax_train.set_xlabel("step")
    ax_train.set_ylabel("mean reward (sampled episodes of the step)")
    versions = [p["version"] for p in run["curve"]]
    for scope in (k for k in run["curve"][0] if k != "version"):
        style = "--" if scope == "team" else ":" if scope.startswith("team:") else "-"
        ax_eval.plot(versions, [p[scope] for p in run["curve"]], marker="o", linestyle=style,
                     label=scope.replace("team:", "team, held-out ") + (" rows" if ":" in scope else ""))
    ax_eval.set_xlabel("version (RL steps after the warm start)")
    ax_eval.set_ylabel("held-out success")
    for ax in (ax_train, ax_eval):
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def eval_settings(spec: dict[str, Any], every: int | None, samples: int | None) -> tuple[int, int]:
    """The held-out rounds' spacing and episodes a row: the flags where given, else the job's ``evaluation``.

    ``sampling: policy`` plays ``samples_per_task`` episodes a row with the agents' sampling; greedy
    (or no ``evaluation``) one argmax episode a row, returned as 0 samples.
    """
    evaluation = spec.get("evaluation") or {}
    if every is None:
        every = int(evaluation.get("every_versions", 10))
    if samples is None:
        policy = evaluation.get("sampling", "greedy") == "policy"
        samples = int(evaluation.get("samples_per_task", 1)) if policy else 0
    if every < 1 or samples < 0:
        raise SystemExit(f"--eval-every must be >= 1 and --eval-samples >= 0 (got {every}, {samples})")
    return every, samples


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the seeds and prints each held-out curve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=0, help="default: the job's total_steps")
    parser.add_argument("--eval-every", type=int, default=None, help="default: the job's evaluation.every_versions")
    parser.add_argument("--eval-samples", type=int, default=None,
                        help="0: held-out rounds greedy, one episode a row; k: k episodes a row, the agents' sampling "
                             "(default: the job's evaluation: samples_per_task with sampling: policy, else 0)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "flexmarl-signaling-models"))
    parser.add_argument("--json-out", default="")
    parser.add_argument("--plot", default="", help="PNG of the first seed's run")
    parser.add_argument("--plot-from", default="", help="only plot this --json-out file's first run to --plot")
    args = parser.parse_args(argv)
    if args.plot_from:
        saved = json.loads(Path(args.plot_from).read_text())
        plot_run(saved["runs"][0], Path(args.plot), f"{saved['spec']['name']}, seed {saved['runs'][0]['seed']}")
        return 0
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    spec, steps, cache_dir = read_job(args.job, args.set, args.steps, args.cache_dir)
    every, samples = eval_settings(spec, args.eval_every, args.eval_samples)
    runs = [run_seed(spec, Path(args.job).resolve().parent, seed, steps, every, cache_dir, samples)
            for seed in args.seeds]
    for run in runs:
        keys = [k for k in run["curve"][0] if k != "version"]
        print(f"\nseed {run['seed']} (CPU {run['cpu_s']:.0f} s, wall {run['wall_s']:.0f} s)")
        print("| version | " + " | ".join(keys) + " |")
        for point in run["curve"]:
            print(f"| {point['version']} | " + " | ".join(f"{point[k]:.3f}" for k in keys) + " |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"spec": spec, "runs": runs}, indent=1))
    if args.plot:
        plot_run(runs[0], Path(args.plot), f"{spec['name']}, seed {runs[0]['seed']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
