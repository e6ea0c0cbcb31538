"""Do LoRA signaling agents learn in process? benchmarks/signaling_learning.py with PEFT adapters (issue 17).

The same in-process GRPO simulation as :mod:`benchmarks.signaling_learning` (the real
environment through :class:`rolloutd.runner.RolloutRunner`, the batched full-vocabulary sampler,
traind's advantages, packing, logprobs, losses, step normaliser and clipping), but every agent is
a LoRA adapter built exactly as traind builds it: :func:`traind.lora.attach_adapter` over the
agent's frozen base (``peft.get_peft_model`` with :meth:`traind.lora.LoraSettings.peft_config`,
the initial adapter seeded by the agent's name) and one AdamW over the adapter's parameters. Each
agent gets its own copy of the base in memory (traind shares one per slot; the adapters are what
differ). Runs examples/signaling_lora/job.yaml by default (``pairs`` from its environment
config; ``--set environment.config.pairs=1`` plays one pair), or any job whose agents have
``base`` + ``lora``, or ``model`` (a full model, as signaling_learning.py trains it).

Seeds: run seed s uses job seed s and base weights seed ``2s + 1`` for every ``tiny://...?seed=1``
base (seed 0 is exactly the job file).

Usage (repo root)::

    python benchmarks/lora_signaling_sim.py --seeds 0 --set environment.config.pairs=1
    python benchmarks/lora_signaling_sim.py --seeds 0 1 2 --set agents.*.optimizer.lr=1e-2 \\
        --set 'agents.*.lora.target_modules=[q_proj,v_proj]' --json-out out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from benchmarks.report import Column, render_table  # noqa: E402
from benchmarks.signaling_learning import (  # noqa: E402
    AgentState,
    BatchedBackend,
    RunResult,
    StepRow,
    agent_algorithm,
    checkpoint,
    loss_settings,
    read_job,
    rollout_step,
    train_step,
)
from examples.signaling_lora.env import pair_agents  # noqa: E402
from flexmarl.episode import load_environment  # noqa: E402
from rolloutd.runner import AgentRuntime, RolloutRunner  # noqa: E402
from rolloutd.tokenizers import HFTokenizer  # noqa: E402
from traind import losses  # noqa: E402

logger = logging.getLogger(__name__)


def weight_seed(uri: str, run_seed: int) -> int:
    """The weight seed of an agent's model for run seed ``run_seed``: the URI's ``seed`` (default 1) shifted by 2s."""
    params = urllib.parse.parse_qs(urllib.parse.urlparse(uri).query)
    return int(params.get("seed", ["1"])[-1]) + 2 * run_seed


def build_agent(spec: dict[str, Any], agent: dict[str, Any], cache_dir: Path, run_seed: int) -> tuple[
        AgentState, AgentRuntime, int]:
    """One agent's policy (a PEFT adapter over its own copy of the base, or a full model), optimizer and runtime.

    Returns the state, the runtime and the number of trainable parameters.
    """
    from transformers import AutoModelForCausalLM

    from traind.lora import LoraSettings, attach_adapter

    uri = agent.get("base") or agent["model"]
    path = checkpoint(cache_dir, uri, weight_seed(uri, run_seed))
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.config.use_cache = False
    if agent.get("lora"):
        cfg = agent["lora"]
        settings = LoraSettings(rank=int(cfg["rank"]), alpha=int(cfg["alpha"]), dropout=float(cfg.get("dropout", 0.0)),
                                target_modules=tuple(cfg["target_modules"]))
        model.requires_grad_(False)  # as traind's LoraBaseCache hands the base out
        model = attach_adapter(model, settings, agent["name"])
    model.eval()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = agent["optimizer"]
    optimizer = torch.optim.AdamW(trainable, lr=float(opt["lr"]), betas=tuple(opt.get("betas", (0.9, 0.999))),
                                  eps=float(opt.get("eps", 1e-8)), weight_decay=float(opt.get("weight_decay", 0.0)))
    eos = model.generation_config.eos_token_id
    eos_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    algo = agent_algorithm(spec, agent)
    loss_config, schedule = loss_settings(algo)
    if loss_config.kl_coef > 0.0:
        raise ValueError("kl_coef > 0 is not simulated for LoRA agents here")
    temperature = float(agent.get("sampling", {}).get("temperature", 1.0))
    state = AgentState(agent["name"], model, optimizer, float(opt.get("grad_clip", 1.0)), eos_ids, loss_config,
                       losses.AdvantageNorm(algo.get("advantage_norm", "std")),
                       losses.TurnBaseline(algo.get("turn_baseline", "episode")), schedule, temperature)
    sampling = {k: v for k, v in agent.get("sampling", {}).items() if k not in ("top_k", "top_p") or v not in (-1, 1.0)}
    if not sampling.get("stop_token_ids"):
        sampling.pop("stop_token_ids", None)
    return state, AgentRuntime(HFTokenizer(str(path)), sampling), sum(p.numel() for p in trainable)


def played_agents(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's agents that the environment plays (``pairs`` < the job's pairs drops the others)."""
    config = spec["environment"].get("config", {})
    if "pairs" not in config:
        return list(spec["agents"])
    names = set(pair_agents(int(config["pairs"]), bool(config.get("observer", False))))
    return [a for a in spec["agents"] if a["name"] in names]


def run_seed(spec: dict[str, Any], seed: int, steps: int, cache_dir: Path, target: float, quiet: bool) -> RunResult:
    """Trains the played agents of ``spec`` for ``steps`` steps with run seed ``seed``."""
    import traind.model  # noqa: F401  (heavy: imports deepspeed; keep it out of the step timings)

    started = time.perf_counter()
    env = load_environment(spec["environment"]["entrypoint"], spec["environment"].get("config", {}))
    prompts_per_step, group_size = int(spec["batch"]["prompts_per_step"]), int(spec["batch"]["group_size"])
    torch.manual_seed(seed)
    states: dict[str, AgentState] = {}
    runtimes: dict[str, AgentRuntime] = {}
    for agent in played_agents(spec):
        states[agent["name"]], runtimes[agent["name"]], trainable = build_agent(spec, agent, cache_dir, seed)
        logger.info("agent %s: %d trainable parameters", agent["name"], trainable)
    backend = BatchedBackend(states, torch.Generator().manual_seed(seed))
    runner = RolloutRunner(env, runtimes, backend, clock_ms=lambda: 0)
    setup_s = time.perf_counter() - started
    rows: list[StepRow] = []
    for step in range(steps):
        t0 = time.perf_counter()
        results, records = rollout_step(runner, step, prompts_per_step, seed, group_size)
        episodes = [ret for res in results for ret in res.returns.values()]
        reward_mean = {a: statistics.fmean(e[a] for e in episodes) for a in states}
        mean = statistics.fmean(reward_mean.values())
        for name, state in states.items():
            train_step(state, [r for r in records if r.agent == name], step)
        seconds = time.perf_counter() - t0
        # success: the mean reward over the agents (each pair's 0/1 success, counted for both of its agents)
        rows.append(StepRow(step, reward_mean, mean, mean, seconds))
        if not quiet:
            print(f"seed {seed} step {step:3d} mean={mean:.3f} min={min(reward_mean.values()):.3f} {seconds:.2f}s",
                  flush=True)
    return RunResult(seed, rows, target, setup_s)


def first_mean_at(result: RunResult, threshold: float) -> int | None:
    """Training steps done before the first step whose mean reward over the agents is >= ``threshold``."""
    for row in result.rows:
        if row.success >= threshold:
            return row.step + 1
    return None


def main(argv: list[str] | None = None) -> int:
    """Runs the simulation for several seeds and prints a summary table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default=str(REPO_ROOT / "examples" / "signaling_lora" / "job.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                        help="override a spec field, e.g. agents.*.optimizer.lr=1e-2 or environment.config.pairs=1")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=0, help="default: the job's total_steps")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "flexmarl-signaling-models"))
    parser.add_argument("--json-out", default="")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    spec, steps, cache_dir = read_job(args.job, args.set, args.steps, args.cache_dir)
    results = [run_seed(spec, seed, steps, cache_dir, args.target, args.quiet) for seed in args.seeds]
    agents = played_agents(spec)
    print(f"\nconfig: env={spec['environment'].get('config')} batch={spec['batch']} agents={len(agents)} "
          f"lora={agents[0].get('lora')} lr={agents[0]['optimizer']['lr']}")
    columns = [Column("seed", 4), Column(f"steps to mean {args.target}", 19), Column("seconds", 8, fmt=".1f"),
               Column("s/step", 7, fmt=".3f"), Column("first5 mean", 11, fmt=".3f"),
               Column("last5 mean", 10, fmt=".3f"), Column("last5 min agent", 15, fmt=".3f")]
    rows: list[list[object]] = []
    summary: list[dict[str, Any]] = []
    for res in results:
        hit = first_mean_at(res, args.target)
        secs = res.seconds_to(hit)
        per_step = statistics.fmean(r.seconds for r in res.rows)
        first5 = statistics.fmean(r.success for r in res.rows[:5])
        last5 = statistics.fmean(r.success for r in res.rows[-5:])
        last5_min = statistics.fmean(min(r.reward_mean.values()) for r in res.rows[-5:])
        rows.append([res.seed, hit if hit is not None else "-", secs if secs is not None else float("nan"), per_step,
                     first5, last5, last5_min])
        summary.append({"seed": res.seed, "steps_to_target": hit, "seconds_to_target": secs,
                        "seconds_per_step": per_step, "first5_mean": first5, "last5_mean": last5,
                        "setup_seconds": res.setup_seconds, "rows": [dataclasses.asdict(r) for r in res.rows]})
    print("\n".join(render_table(columns, rows)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"spec": spec, "target": args.target, "runs": summary}, indent=1))
    return 0 if all(s["steps_to_target"] is not None for s in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
