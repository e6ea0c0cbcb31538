"""Does the arithmetic solver + verifier example learn? An in-process warm start + GRPO run of examples/arithmetic.

Like benchmarks/signaling_learning.py, this runs the *real* environment
(``examples.arithmetic.env:ArithmeticGame``) through the real :class:`rolloutd.runner.RolloutRunner`
against an in-process batched sampler (:class:`benchmarks.signaling_learning.BatchedBackend`), and
trains each agent with traind's own pieces:

* warm start (``agents[i].warm_start``): the examples of :func:`traind.sft.dataset_examples` (the
  job seed's), cut into steps of ``batch_size``, the loss of :func:`traind.sft.sft_loss_sum` divided
  by the step's response tokens, the agent's AdamW at ``warm_start.lr``, gradient clipping to
  ``grad_clip``, the torch seed of :meth:`traind.sft.WarmStart.torch_seed`; then a fresh optimizer
  at the agent's ``lr``, as traind resets it (:func:`traind.sft.reset_to_version_zero`);
* RL: GRPO with :func:`traind.batches.micro_batch_advantages`, :func:`traind.batches.pack_micro_batch`
  and :mod:`traind.losses`, loss sums over the whole step divided by its response tokens, one AdamW
  step per training step. Strict on-policy: rollout batch t is sampled by version t of both agents.

Step 0's rollouts are sampled by the warm-started models before any RL update: they are the "SFT"
level. Per step: the solver's accuracy (its answers that are the sum), the verifier's accuracy (the
share of its judgements that are right; its reward may weight them by class), its precision (of the
answers it called correct, the share that were), recall (of the correct answers, the share it called
correct), specificity (of the wrong answers, the share it called wrong), the share of its judgements
whose written sum is right and whose work agrees with them (``env.work_agrees``), and wall seconds.
Per run: its process CPU seconds, the solver's greedy accuracy over every operand pair after the
warm start and after RL, and the **verifier probe**: the verifier's greedy precision, specificity
and accuracy on one fixed set, the warm-started solver's greedy answers to every pair, after the
warm start and after RL. The sampled per-step precision moves with the solver's accuracy (the base
rate); the probe's base rate is fixed, so a rise there is the verifier's own.

Seeds: run seed s uses job seed s and tiny checkpoints with weight seeds ``2s+1`` (solver) and
``2s+2`` (verifier); seed 0 is exactly examples/arithmetic/job.yaml.

Usage (repo root)::

    python benchmarks/arithmetic_learning.py --seeds 0 1 2 --json-out benchmarks/results/arithmetic_learning.json
"""

from __future__ import annotations

import argparse
import dataclasses
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

from benchmarks.report import Column, render_table  # noqa: E402
from benchmarks.signaling_learning import BatchedBackend, checkpoint, read_job, rollout_step  # noqa: E402
from examples.arithmetic.env import (  # noqa: E402
    ArithmeticGame,
    judgement,
    parse_answer,
    question,
    work_agrees,
    written_digits,
)
from flexmarl.episode import load_environment  # noqa: E402
from flexmarl.experience import ExperienceRecord  # noqa: E402
from rolloutd.runner import AgentRuntime, RolloutRunner  # noqa: E402
from rolloutd.tokenizers import HFTokenizer  # noqa: E402
from traind import losses, sft  # noqa: E402

logger = logging.getLogger(__name__)

TAIL_STEPS = 5


@dataclasses.dataclass
class Agent:
    """One agent's policy and optimizer (the shape BatchedBackend samples from)."""

    name: str
    model: Any
    optimizer: torch.optim.Optimizer
    grad_clip: float
    eos_token_ids: frozenset[int]


def adamw(model: Any, opt: dict[str, Any], lr: float) -> torch.optim.Optimizer:
    """The agent's AdamW (its betas, eps, weight decay) at ``lr``."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(opt.get("betas", (0.9, 0.999))),
                             eps=float(opt.get("eps", 1e-8)), weight_decay=float(opt.get("weight_decay", 0.0)))


def clipped_step(agent: Agent, loss: torch.Tensor) -> float:
    """Backward, clip to grad_clip, step; returns the norm before clipping."""
    agent.optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    norm = float(torch.nn.utils.clip_grad_norm_(agent.model.parameters(),
                                                agent.grad_clip if agent.grad_clip > 0 else math.inf))
    agent.optimizer.step()
    return norm


def warm_start(agent: Agent, warm: sft.WarmStart, tokenizer_path: str) -> list[float]:
    """traind's warm start on a plain torch model: returns each step's token-mean loss."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    examples = sft.dataset_examples(warm, lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
                                    tokenizer.eos_token_id)
    step_losses = []
    agent.model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(warm.torch_seed())
        for step in range(warm.steps):
            batch = examples[step * warm.batch_size: (step + 1) * warm.batch_size]
            loss_sum, tokens = sft.sft_loss_sum(agent.model, sft.pack_examples(batch))
            clipped_step(agent, loss_sum / tokens)
            step_losses.append(float(loss_sum.detach()) / tokens)
    agent.model.eval()
    return step_losses


def rl_step(agent: Agent, records: Sequence[ExperienceRecord], config: losses.PolicyLossConfig,
            norm: losses.AdvantageNorm = losses.AdvantageNorm.STD) -> float:
    """One GRPO optimizer step over the agent's experiences of the step; returns the grad norm.

    ``norm``: the job's ``algorithm.advantage_norm`` (``agent``: over these records, the agent's whole step).
    """
    from traind.batches import micro_batch_advantages, pack_micro_batch, token_logprobs_and_entropy

    agent.model.train()
    stats = losses.ReturnStats.of([float(r.reward) for r in records]) if norm is losses.AdvantageNorm.AGENT else None
    advantages = micro_batch_advantages(records, norm, 1e-6, step_stats=stats)
    packed = pack_micro_batch(records, advantages)
    logprobs, entropy = token_logprobs_and_entropy(agent.model, packed.input_ids, packed.attention_mask,
                                                   entropy=config.entropy_coef > 0.0)
    terms = losses.policy_loss_per_token(logprobs, packed.behavior_logprobs, packed.advantages,
                                         packed.response_mask, config, None, entropy)
    loss_sum = losses.aggregate_sum(terms.loss, packed.response_mask, config.loss_agg)
    normaliser = losses.step_normaliser(config.loss_agg, int(packed.response_mask.sum().item()), len(records))
    norm = clipped_step(agent, loss_sum / normaliser)
    agent.model.eval()
    return norm


@dataclasses.dataclass
class StepRow:
    """Metrics of one step's rollouts (sampled before that step's update)."""

    step: int
    solver_accuracy: float
    verifier_accuracy: float
    precision: float  # of the answers judged correct, the share that were; nan when none was judged correct
    recall: float  # of the correct answers, the share judged correct; nan when none was correct
    judged_correct: float  # share of episodes the verifier called correct
    seconds: float
    specificity: float = math.nan  # of the wrong answers, the share judged wrong; nan when none was wrong
    verifier_sum: float = math.nan  # share of judgements whose written sum (the first half of its digits) is a + b
    work_agrees: float = math.nan  # share of judgements that follow from their own work (env.work_agrees)


def step_row(step: int, records: Sequence[ExperienceRecord], seconds: float) -> StepRow:
    """The figures of one step from its experiences (solver reward = correctness, verifier's token = its verdict)."""
    correct: dict[tuple[str, int], bool] = {}
    verdict: dict[tuple[str, int], bool | None] = {}
    shown: dict[tuple[str, int], int | None] = {}  # the solver's answer, as the environment reads it
    total: dict[tuple[str, int], int] = {}
    judged: dict[tuple[str, int], list[int]] = {}
    for rec in records:
        key = (rec.task_id, rec.sample_index)
        if rec.agent == "solver":
            # Correct means reward 1: a wrong answer may earn digit credit below 1.
            correct[key] = rec.reward == 1.0
            shown[key] = parse_answer([int(t) for t in rec.response_token_ids])
            prompt = bytes(int(t) for t in rec.prompt_token_ids if int(t) < 256).decode("ascii")  # "a+b="
            a, _, b = prompt.rstrip("=").partition("+")
            total[key] = int(a) + int(b)
        else:
            judged[key] = [int(t) for t in rec.response_token_ids]
            verdict[key] = judgement(judged[key])
    own_sum: dict[tuple[str, int], bool] = {}
    agrees: dict[tuple[str, int], bool] = {}
    for key, tokens in judged.items():
        digits = written_digits(tokens)
        own_sum[key] = len(digits) >= 2 and digits[:len(digits) // 2] == str(total[key])
        agrees[key] = work_agrees(tokens, shown[key])
    keys = sorted(correct)
    said_yes = [k for k in keys if verdict.get(k) is True]
    right = [k for k in keys if correct[k]]
    wrong = [k for k in keys if not correct[k]]
    precision = statistics.fmean(correct[k] for k in said_yes) if said_yes else math.nan
    recall = statistics.fmean(verdict.get(k) is True for k in right) if right else math.nan
    # Accuracy from the verdicts, not the verifier's reward: the job may weight the reward by class.
    verifier_accuracy = statistics.fmean(verdict.get(k) == correct[k] for k in keys)
    specificity = statistics.fmean(verdict.get(k) is False for k in wrong) if wrong else math.nan
    return StepRow(step, statistics.fmean(correct[k] for k in keys), verifier_accuracy, precision, recall,
                   len(said_yes) / len(keys), seconds, specificity,
                   statistics.fmean(own_sum.get(k, False) for k in keys),
                   statistics.fmean(agrees.get(k, False) for k in keys))


@torch.no_grad()
def greedy_decode(agent: Agent, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Argmax continuations of ``prompts`` (left-padded as BatchedBackend samples), each up to its EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(list(prompt))
        mask[i, width - len(prompt):] = 1
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = agent.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        tokens = logits[:, -1, :].argmax(-1)
        for i, token in enumerate(tokens.tolist()):
            if not done[i]:
                outputs[i].append(token)
                done[i] = token in agent.eos_token_ids
        ids = torch.cat([ids, tokens.unsqueeze(-1)], dim=1)
        mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=torch.long)], dim=1)
    return outputs


@dataclasses.dataclass(frozen=True)
class Probe:
    """Fixed questions and the warm-started solver's greedy answers: what the verifier is judged on."""

    pairs: tuple[tuple[int, int], ...]
    answers: tuple[tuple[int, ...], ...]  # the solver's answer tokens, specials dropped (as the verifier sees them)

    def correct(self) -> list[bool]:
        return [parse_answer(list(answer)) == a + b for answer, (a, b) in zip(self.answers, self.pairs, strict=True)]


def solver_probe(agent: Agent, tokenizer: Any, env: ArithmeticGame, limit: int = 1024) -> tuple[float, Probe]:
    """The solver's greedy accuracy over every operand pair of the job's range (at most ``limit``), and its answers."""
    operands = range(env.min_operand, env.max_operand + 1)
    pairs = tuple((a, b) for a in operands for b in operands)[:limit]
    prompts = [tokenizer.encode(question(a, b), add_special_tokens=False) for a, b in pairs]
    answers = greedy_decode(agent, prompts, env.answer_tokens)
    probe = Probe(pairs, tuple(tuple(t for t in answer if t < 256) for answer in answers))
    return statistics.fmean(parse_answer(answer) == a + b for answer, (a, b) in zip(answers, pairs, strict=True)), probe


def verifier_scores(agent: Agent, tokenizer: Any, probe: Probe, judge_tokens: int) -> dict[str, float]:
    """The verifier's greedy judgements of ``probe``: precision, specificity (wrong answers called wrong), accuracy."""
    prompts = [[*tokenizer.encode(question(a, b), add_special_tokens=False), *answer,
                *tokenizer.encode("?", add_special_tokens=False)] for (a, b), answer in zip(probe.pairs, probe.answers,
                                                                                           strict=True)]
    verdicts = [judgement(out) for out in greedy_decode(agent, prompts, judge_tokens)]
    correct = probe.correct()
    said_yes = [c for c, v in zip(correct, verdicts, strict=True) if v is True]
    wrong = [v for c, v in zip(correct, verdicts, strict=True) if not c]
    return {"precision": statistics.fmean(said_yes) if said_yes else math.nan,
            "specificity": statistics.fmean(v is False for v in wrong) if wrong else math.nan,
            "accuracy": statistics.fmean(v == c for c, v in zip(correct, verdicts, strict=True)),
            "base_rate": statistics.fmean(correct)}


@dataclasses.dataclass
class RunResult:
    """One seed's warm start and RL trajectory."""

    seed: int
    sft_losses: dict[str, list[float]]
    rows: list[StepRow]
    setup_seconds: float
    cpu_seconds: float  # process CPU time of the whole run (warm starts, rollouts, updates)
    greedy_sft: float  # the solver's greedy accuracy after the warm start (every operand pair)
    greedy_last: float  # the same after the RL steps
    verifier_sft: dict[str, float] = dataclasses.field(default_factory=dict)  # verifier_scores after the warm start
    verifier_last: dict[str, float] = dataclasses.field(default_factory=dict)  # the same probe after the RL steps

    def tail(self, field: str) -> float:
        """Mean of ``field`` over the last TAIL_STEPS steps (nan values skipped)."""
        values = [getattr(r, field) for r in self.rows[-TAIL_STEPS:]]
        finite = [v for v in values if not math.isnan(v)]
        return statistics.fmean(finite) if finite else math.nan

    def start(self, field: str) -> float:
        """``field`` at step 0: the warm-started models before any RL update."""
        return float(getattr(self.rows[0], field))


def run_seed(spec: dict[str, Any], seed: int, steps: int, cache_dir: Path, quiet: bool) -> RunResult:
    """Warm-starts and trains both agents of ``spec`` for ``steps`` RL steps with run seed ``seed``."""
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    cpu_started = time.process_time()
    env = load_environment(spec["environment"]["entrypoint"], spec["environment"].get("config", {}))
    algo = spec.get("algorithm", {})
    if float(algo.get("kl_coef", 0.0)) > 0:
        raise ValueError("kl_coef > 0 is not simulated (and a warm start rejects it)")
    loss_config = losses.PolicyLossConfig(
        clip_eps_low=float(algo.get("clip_eps", 0.2)), clip_eps_high=float(algo.get("clip_eps", 0.2)),
        loss_agg=losses.LossAggregation(algo.get("loss_agg", "token-mean")),
        entropy_coef=float(algo.get("entropy_coef", 0.0)))
    batch = spec["batch"]
    prompts_per_step, group_size = int(batch["prompts_per_step"]), int(batch["group_size"])
    torch.manual_seed(seed)
    agents: dict[str, Agent] = {}
    runtimes: dict[str, AgentRuntime] = {}
    sft_losses: dict[str, list[float]] = {}
    for index, agent_spec in enumerate(spec["agents"]):
        name = agent_spec["name"]
        path = checkpoint(cache_dir, agent_spec["model"], 2 * seed + 1 + index)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        model.eval()  # type: ignore[no-untyped-call]
        opt = agent_spec["optimizer"]
        eos = model.generation_config.eos_token_id
        eos_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        warm_spec = agent_spec.get("warm_start")
        agent = Agent(name, model, adamw(model, opt, float(opt["lr"])), float(opt.get("grad_clip", 1.0)), eos_ids)
        if warm_spec is not None:
            warm = sft.WarmStart(agent=name, dataset=warm_spec["dataset"], steps=int(warm_spec["steps"]),
                                 lr=float(warm_spec.get("lr", 1e-3)), batch_size=int(warm_spec.get("batch_size", 32)),
                                 seed=seed, config=tuple(sorted(warm_spec.get("config", {}).items())))
            agent.optimizer = adamw(model, opt, warm.lr)
            sft_losses[name] = warm_start(agent, warm, str(path))
            agent.optimizer = adamw(model, opt, float(opt["lr"]))  # RL starts with a fresh optimizer
        agents[name] = agent
        sampling = {k: v for k, v in agent_spec.get("sampling", {}).items()
                    if k not in ("top_k", "top_p") or v not in (-1, 1.0)}
        if not sampling.get("stop_token_ids"):
            sampling.pop("stop_token_ids", None)
        runtimes[name] = AgentRuntime(HFTokenizer(str(path)), sampling)
    if not isinstance(env, ArithmeticGame):
        raise ValueError("the job's environment is not examples.arithmetic.env:ArithmeticGame")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint(cache_dir, spec["agents"][0]["model"], 2 * seed + 1)),
                                              local_files_only=True)  # the byte-level tokenizer both agents share
    greedy_sft, probe = solver_probe(agents["solver"], tokenizer, env)
    verifier_sft = verifier_scores(agents["verifier"], tokenizer, probe, env.judge_tokens)
    backend = BatchedBackend(agents, torch.Generator().manual_seed(seed))  # type: ignore[arg-type]
    runner = RolloutRunner(env, runtimes, backend, clock_ms=lambda: 0)
    setup_s = time.perf_counter() - started
    if not quiet:
        print(f"seed {seed}: warm start " + " ".join(f"{a} loss {v[0]:.3f}->{v[-1]:.3f}" for a, v in sft_losses.items())
              + f"; solver greedy accuracy {greedy_sft:.3f}; verifier greedy on its answers "
              + " ".join(f"{k} {v:.3f}" for k, v in verifier_sft.items()) + f" ({setup_s:.1f}s)", flush=True)
    rows: list[StepRow] = []
    # The agent's own `algorithm.advantage_norm`, else the job's (JobSpec.algorithm_of, as traind reads it).
    norms = {a["name"]: losses.AdvantageNorm(a.get("algorithm", {}).get("advantage_norm")
                                             or algo.get("advantage_norm", "std")) for a in spec["agents"]}
    for step in range(steps):
        t0 = time.perf_counter()
        _, records = rollout_step(runner, step, prompts_per_step, seed, group_size)
        for name, agent in agents.items():
            rl_step(agent, [r for r in records if r.agent == name], loss_config, norms[name])
        row = step_row(step, records, time.perf_counter() - t0)
        rows.append(row)
        if not quiet:
            print(f"seed {seed} step {step:3d} solver acc={row.solver_accuracy:.3f} verifier acc="
                  f"{row.verifier_accuracy:.3f} precision={row.precision:.3f} recall={row.recall:.3f} "
                  f"specificity={row.specificity:.3f} yes={row.judged_correct:.2f} own sum={row.verifier_sum:.2f} "
                  f"work agrees={row.work_agrees:.2f} {row.seconds:.2f}s", flush=True)
    greedy_last, _ = solver_probe(agents["solver"], tokenizer, env)
    verifier_last = verifier_scores(agents["verifier"], tokenizer, probe, env.judge_tokens)
    return RunResult(seed, sft_losses, rows, setup_s, time.process_time() - cpu_started, greedy_sft, greedy_last,
                     verifier_sft, verifier_last)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the example for several seeds, prints a summary table, writes JSON when asked."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--job", default=str(REPO_ROOT / "examples" / "arithmetic" / "job.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                        help="override a spec field, e.g. agents.0.warm_start.steps=100")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=0, help="RL steps; default: the job's total_steps")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "flexmarl-arithmetic-models"))
    parser.add_argument("--json-out", default="")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    spec, steps, cache_dir = read_job(args.job, args.set, args.steps, args.cache_dir)
    results = [run_seed(spec, seed, steps, cache_dir, args.quiet) for seed in args.seeds]
    columns = [Column("seed", 4), Column("solver SFT", 10, fmt=".3f"),
               Column(f"solver last{TAIL_STEPS}", 12, fmt=".3f"),
               Column("verif acc SFT", 13, fmt=".3f"), Column(f"verif acc last{TAIL_STEPS}", 16, fmt=".3f"),
               Column("precision SFT", 13, fmt=".3f"), Column(f"precision last{TAIL_STEPS}", 16, fmt=".3f"),
               Column("recall SFT", 10, fmt=".3f"), Column(f"recall last{TAIL_STEPS}", 13, fmt=".3f"),
               Column("specif SFT", 10, fmt=".3f"), Column(f"specif last{TAIL_STEPS}", 13, fmt=".3f"),
               Column("own sum SFT", 11, fmt=".3f"), Column(f"own sum last{TAIL_STEPS}", 14, fmt=".3f"),
               Column("greedy SFT", 10, fmt=".3f"), Column("greedy end", 10, fmt=".3f"),
               Column("v-probe prec SFT", 16, fmt=".3f"), Column("v-probe prec end", 16, fmt=".3f"),
               Column("v-probe spec SFT", 16, fmt=".3f"), Column("v-probe spec end", 16, fmt=".3f"),
               Column("seconds", 8, fmt=".1f"), Column("CPU s", 7, fmt=".1f")]
    table: list[list[object]] = []
    runs: list[dict[str, Any]] = []
    for res in results:
        seconds = res.setup_seconds + sum(r.seconds for r in res.rows)
        figures = {f: (res.start(f), res.tail(f)) for f in ("solver_accuracy", "verifier_accuracy", "precision",
                                                             "recall", "specificity", "verifier_sum")}
        table.append([res.seed, *[v for pair in figures.values() for v in pair], res.greedy_sft, res.greedy_last,
                      res.verifier_sft["precision"], res.verifier_last["precision"],
                      res.verifier_sft["specificity"], res.verifier_last["specificity"], seconds, res.cpu_seconds])
        runs.append({"seed": res.seed, "seconds": seconds, "cpu_seconds": res.cpu_seconds,
                     "setup_seconds": res.setup_seconds,
                     "sft_losses": res.sft_losses,
                     "solver_greedy": {"sft": res.greedy_sft, "end": res.greedy_last},
                     "verifier_probe": {"sft": res.verifier_sft, "end": res.verifier_last},
                     "sft": {f: start for f, (start, _) in figures.items()},
                     "last": {f: tail for f, (_, tail) in figures.items()},
                     "rows": [dataclasses.asdict(r) for r in res.rows]})
    print(f"\nconfig: {args.job} {' '.join(args.set)} steps={steps}")
    print("\n".join(render_table(columns, table)))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"spec": spec, "steps": steps, "runs": runs}, indent=1))
    # Exit 0 when every seed's solver (greedy, every pair) and verifier (greedy precision on the fixed probe) rose.
    improved = all(r["solver_greedy"]["end"] > r["solver_greedy"]["sft"]
                   and r["verifier_probe"]["end"]["precision"] > r["verifier_probe"]["sft"]["precision"] for r in runs)
    return 0 if improved else 1


if __name__ == "__main__":
    raise SystemExit(main())
