"""Ready-made workflows (flexmarl/workflows/) on scripted agents: turn order, prompts, rewards per role, notes.

The agents are a scripted backend: each agent's replies, in order, and every prompt it was
sent. Episodes run through rolloutd's RolloutRunner, so the rewards checked are the returns the
experiences carry (episode-level rewards on every turn of the agent, gamma 1).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from byte_tokenizers import ContentBytes

from flexmarl.datasets import open_dataset
from flexmarl.episode import EpisodeRecord, Task, TurnRecord, load_environment
from flexmarl.errors import InvalidArgument, Unavailable
from flexmarl.jobspec import parse_job_spec
from flexmarl.preflight import preflight_problems
from flexmarl.workflows import Chain, Debate, Mixture, SolverVerifier, Workflow
from rolloutd.runner import AgentRuntime, GenerationOutput, RolloutResult, RolloutRunner, RolloutTaskInput

REPO_ROOT = Path(__file__).resolve().parents[2]
ROW = {"question": "Tom has 3 apples and buys 4. How many?", "answer": 7}
NUMERIC = {"function": "numeric_match", "field": "answer"}


class Scripted:
    """Each agent answers its scripted replies in order; every call is kept as (agent, prompt text)."""

    def __init__(self, replies: Mapping[str, Sequence[str]]) -> None:
        self.replies = {agent: list(texts) for agent, texts in replies.items()}
        self.calls: list[tuple[str, str]] = []

    async def generate(self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int,
                       affinity_key: str) -> list[GenerationOutput]:
        self.calls.append((agent, bytes(input_ids).decode()))
        ids = tuple(self.replies[agent].pop(0).encode())
        return [GenerationOutput(ids, (-0.5,) * len(ids), "stop", 0)]

    def prompts(self, agent: str) -> list[str]:
        return [prompt for who, prompt in self.calls if who == agent]


async def play(env: Workflow, backend: Scripted) -> tuple[RolloutResult, dict[tuple[str, int], float], dict[str, Any]]:
    """One episode of ``env`` on ``ROW``: the result, (agent, turn) -> reward and the episode's notes."""
    notes: list[Mapping[str, Any]] = []

    def record(task: Task, turn: TurnRecord, reward: float, *, episode: EpisodeRecord) -> float:
        notes.append(episode.notes)
        return reward

    env.shape_reward = record  # type: ignore[method-assign]
    runtimes = {agent: AgentRuntime(ContentBytes(), {"max_new_tokens": 64}) for agent in env.agents}
    try:
        result = await RolloutRunner(env, runtimes, backend, clock_ms=lambda: 0, coalesce_first_turn=False).run(
            RolloutTaskInput("job", "job/0/0", 0, 0, 1))
    finally:
        await env.aclose()
    rewards = {(e.agent, e.turn): e.reward for e in result.experiences}
    return result, rewards, dict(notes[0]) if notes else {}


def config(**overrides: Any) -> dict[str, Any]:
    return {"reward": NUMERIC, "tasks": [ROW], "chat": False, **overrides}


async def test_solver_verifier_revises_after_a_rejection_and_rewards_each_verdict() -> None:
    env = SolverVerifier(**config(rounds=2, prompts={"verify": "Q: {question} A: {attempt} ok?",
                                                      "revise": "Q: {question} A: {attempt} R: {feedback} again"}))
    backend = Scripted({"solver": ["3 + 4 = 8. Answer: 8", "Answer: 7"],
                        "verifier": ["REJECT: 3 + 4 is 7", "ACCEPT, it adds up"]})
    result, rewards, notes = await play(env, backend)
    assert result.ok, result.errors
    assert [agent for agent, _ in backend.calls] == ["solver", "verifier", "solver", "verifier"]
    assert backend.prompts("solver")[0] == f"Solve the problem. End with 'Answer: <answer>'.\n\n{ROW['question']}"
    assert backend.prompts("verifier") == [f"Q: {ROW['question']} A: 3 + 4 = 8. Answer: 8 ok?",
                                           f"Q: {ROW['question']} A: Answer: 7 ok?"]
    assert backend.prompts("solver")[1] == f"Q: {ROW['question']} A: 3 + 4 = 8. Answer: 8 R: REJECT: 3 + 4 is 7 again"
    # The solver's final answer is right: 1 on both its turns. The verifier was right twice, at turns 0 and 1:
    # turn 0's return is its reward plus turn 1's (gamma 1).
    assert rewards == {("solver", 0): 1.0, ("solver", 1): 1.0, ("verifier", 0): 2.0, ("verifier", 1): 1.0}
    assert notes == {"success": True, "answer": "Answer: 7", "role_correct": {"solver": 1.0, "verifier": 1.0}}


async def test_solver_verifier_a_wrong_acceptance_ends_the_episode_and_earns_the_verifier_nothing() -> None:
    env = SolverVerifier(**config(rounds=3, rewards={"verifier": {**NUMERIC, "weight": 0.5}}))
    backend = Scripted({"solver": ["Answer: 8"], "verifier": ["I ACCEPT (no REJECT)"]})
    _, rewards, notes = await play(env, backend)
    assert [agent for agent, _ in backend.calls] == ["solver", "verifier"]
    assert rewards == {("solver", 0): 0.0, ("verifier", 0): 0.0}
    assert notes["success"] is False and notes["role_correct"] == {"solver": 0.0, "verifier": 0.0}


async def test_solver_verifier_revises_after_the_last_rejection_unverified() -> None:
    env = SolverVerifier(**config(rounds=1, rewards={"verifier": {**NUMERIC, "weight": 0.5}}))
    backend = Scripted({"solver": ["Answer: 8", "Answer: 7"], "verifier": ["no idea"]})  # neither word: rejects
    _, rewards, notes = await play(env, backend)
    assert [agent for agent, _ in backend.calls] == ["solver", "verifier", "solver"]
    assert rewards == {("solver", 0): 1.0, ("solver", 1): 1.0, ("verifier", 0): 0.5}  # weight 0.5
    assert notes["success"] is True and notes["answer"] == "Answer: 7"


async def test_solver_verifier_accept_weight_scales_only_a_right_acceptance() -> None:
    env = SolverVerifier(**config(rounds=2, accept_weight=2.5))
    backend = Scripted({"solver": ["Answer: 8", "Answer: 7"], "verifier": ["REJECT", "ACCEPT"]})
    _, rewards, notes = await play(env, backend)
    # A right rejection earns 1, the right acceptance after it 2.5 (turn 0's return adds turn 1's).
    assert rewards == {("solver", 0): 1.0, ("solver", 1): 1.0, ("verifier", 0): 3.5, ("verifier", 1): 2.5}
    assert notes["role_correct"] == {"solver": 1.0, "verifier": 1.0}
    backend = Scripted({"solver": ["Answer: 8"], "verifier": ["ACCEPT"]})  # a wrong acceptance: still nothing
    _, rewards, _ = await play(SolverVerifier(**config(rounds=2, accept_weight=2.5)), backend)
    assert rewards == {("solver", 0): 0.0, ("verifier", 0): 0.0}


async def test_debate_rounds_read_the_others_and_the_majority_decides() -> None:
    env = Debate(**config(debaters=["ann", "bob", "cy"], rounds=2,
                          prompts={"debate": "{question} mine: {previous} theirs: {others}"}))
    backend = Scripted({"ann": ["Answer: 7", "Answer: 7"], "bob": ["Answer: 8", "I now think 7"],
                        "cy": ["Answer: 9", "Answer: 1,000"]})
    _, rewards, notes = await play(env, backend)
    assert [agent for agent, _ in backend.calls[:3]] == ["ann", "bob", "cy"]  # round 1 before round 2
    assert {agent for agent, _ in backend.calls[3:]} == {"ann", "bob", "cy"}
    assert backend.prompts("bob")[1] == f"{ROW['question']} mine: Answer: 8 theirs: [ann] Answer: 7\n\n[cy] Answer: 9"
    assert rewards == {("ann", 0): 1.0, ("ann", 1): 1.0, ("bob", 0): 1.0, ("bob", 1): 1.0,
                       ("cy", 0): 0.0, ("cy", 1): 0.0}
    assert notes == {"success": True, "answer": "Answer: 7", "role_correct": {"debater": 2 / 3}}


async def test_debate_majority_ties_go_to_the_first_debater_and_a_judge_gives_the_final_answer() -> None:
    assert Debate(**config(debaters=["a", "b"])).majority(["Answer: 8", "Answer: 7"]) == "Answer: 8"
    assert Debate(**config(debaters=["a", "b", "c"])).majority(["nothing", "7", "seven: 7"]) == "7"
    env = Debate(**config(debaters=["ann", "bob"], judge="jo", rounds=1, rewards={"judge": {**NUMERIC, "weight": 2}}))
    backend = Scripted({"ann": ["Answer: 7"], "bob": ["Answer: 7"], "jo": ["Answer: 6"]})
    _, rewards, notes = await play(env, backend)
    assert [agent for agent, _ in backend.calls][-1] == "jo"
    assert "[ann] Answer: 7\n\n[bob] Answer: 7" in backend.prompts("jo")[0]
    assert rewards == {("ann", 0): 1.0, ("bob", 0): 1.0, ("jo", 0): 0.0}
    assert notes == {"success": False, "answer": "Answer: 6", "role_correct": {"debater": 1.0, "judge": 0.0}}


async def test_chain_passes_each_output_on_and_shares_the_final_reward() -> None:
    steps = [{"agent": "planner", "prompt": "plan {question}"}, {"agent": "worker", "prompt": "do {previous}"},
             {"agent": "reviewer", "prompt": "check {previous} for {question}"}]
    env = Chain(**config(steps=steps, rewards={"planner": {**NUMERIC, "weight": 0.5}}))
    backend = Scripted({"planner": ["add them"], "worker": ["3+4 = 7"], "reviewer": ["Answer: 7"]})
    _, rewards, notes = await play(env, backend)
    assert backend.calls == [("planner", f"plan {ROW['question']}"), ("worker", "do add them"),
                             ("reviewer", f"check 3+4 = 7 for {ROW['question']}")]
    assert rewards == {("planner", 0): 0.5, ("worker", 0): 1.0, ("reviewer", 0): 1.0}
    assert notes["success"] is True and notes["role_correct"] == {"planner": 1.0, "worker": 1.0, "reviewer": 1.0}


async def test_an_agent_that_takes_two_chain_steps_is_rewarded_once() -> None:
    steps = [{"agent": "a", "prompt": "{question}"}, {"agent": "b", "prompt": "b {previous}"},
             {"agent": "a", "prompt": "a {previous}"}]
    env = Chain(**config(steps=steps))
    backend = Scripted({"a": ["draft", "Answer: 7"], "b": ["7?"]})
    _, rewards, notes = await play(env, backend)
    assert [agent for agent, _ in backend.calls] == ["a", "b", "a"] and backend.prompts("a")[1] == "a 7?"
    assert rewards == {("a", 0): 1.0, ("a", 1): 1.0, ("b", 0): 1.0}  # a's one episode reward, on both its turns
    assert notes["role_correct"] == {"a": 1.0, "b": 1.0}


async def test_mixture_aggregates_the_proposals() -> None:
    env = Mixture(**config(proposers=["p0", "p1", "p2"], prompts={"aggregate": "{proposals}\nso?"}))
    backend = Scripted({"p0": ["Answer: 7"], "p1": ["Answer: 8"], "p2": ["7"], "aggregator": ["Answer: 7.0"]})
    _, rewards, notes = await play(env, backend)
    assert [agent for agent, _ in backend.calls][-1] == "aggregator"
    assert backend.prompts("aggregator") == ["[p0] Answer: 7\n\n[p1] Answer: 8\n\n[p2] 7\nso?"]
    assert rewards == {("p0", 0): 1.0, ("p1", 0): 0.0, ("p2", 0): 1.0, ("aggregator", 0): 1.0}
    assert notes["role_correct"] == {"proposer": 2 / 3, "aggregator": 1.0} and notes["success"] is True


async def test_chat_prompts_carry_the_system_message() -> None:
    class Chat(ContentBytes):
        def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> list[int]:
            return self.encode("|".join(f"{m['role']}:{m['content']}" for m in messages))

    env = Mixture(**config(chat=True, system="be brief", proposers=["p0"]))
    backend = Scripted({"p0": ["7"], "aggregator": ["7"]})
    runtimes = {agent: AgentRuntime(Chat(), {}) for agent in env.agents}
    result = await RolloutRunner(env, runtimes, backend, coalesce_first_turn=False).run(
        RolloutTaskInput("job", "job/0/0", 0, 0, 1))
    await env.aclose()
    assert result.ok and backend.prompts("p0")[0].startswith("system:be brief|user:Solve the problem.")


async def test_a_reward_that_raises_or_hangs_fails_the_episode_with_the_reason() -> None:
    for function, reason in (("reward_functions:raises", "raised ZeroDivisionError: the user's bug"),
                             ("reward_functions:hangs", "timed out after 0.5 s")):
        env = Mixture(**config(proposers=["p0"], reward={"function": function}, reward_timeout_s=0.5))
        result, _, _ = await play(env, Scripted({"p0": ["7"], "aggregator": ["7"]}))
        # A group of one without its episode: given up (not re-issued), nothing to train, no task error.
        assert not result.ok and result.given_up and not result.experiences and not result.errors
        (failed,) = result.failed_episodes
        assert failed.sample_index == 0 and reason in failed.reason


class Failing(Scripted):
    """Scripted, but a reply of ENGINE raises as an engine that went away would."""

    async def generate(self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int,
                       affinity_key: str) -> list[GenerationOutput]:
        if self.replies[agent][0] == "ENGINE":
            self.replies[agent].pop(0)
            raise Unavailable("the engine went away")
        return await super().generate(agent, input_ids, sampling, n, affinity_key)


async def play_group(replies: Mapping[str, Sequence[str]], group_size: int, backend: type[Scripted] = Scripted,
                     ) -> RolloutResult:
    """``group_size`` episodes of a one-proposer mixture scored by reward_functions:fails_on_marks (0.5 s limit)."""
    env = Mixture(**config(proposers=["p0"], reward={"function": "reward_functions:fails_on_marks"},
                           reward_timeout_s=0.5))
    runtimes = {agent: AgentRuntime(ContentBytes(), {"max_new_tokens": 64}) for agent in env.agents}
    try:
        return await RolloutRunner(env, runtimes, backend(replies), clock_ms=lambda: 0,
                                   coalesce_first_turn=False).run(RolloutTaskInput("job", "job/0/0", 0, 0, group_size))
    finally:
        await env.aclose()


async def test_episodes_whose_reward_fails_are_dropped_and_the_rest_of_the_group_trains() -> None:
    result = await play_group({"p0": ["RAISE", "7", "HANG", "7"], "aggregator": ["7"] * 4}, 4)
    assert result.ok and not result.errors and not result.given_up
    reasons = {f.sample_index: f.reason for f in result.failed_episodes}
    assert len(reasons) == 2
    assert any("raised ArithmeticError: cannot score 'RAISE'" in r for r in reasons.values())
    assert any("'reward_functions:fails_on_marks' timed out after 0.5 s" in r for r in reasons.values())
    kept = {e.sample_index for e in result.experiences}
    assert kept == set(range(4)) - set(reasons) and len(kept) == 2  # every agent's turns of the two survivors
    assert {(e.agent, e.sample_index) for e in result.experiences} == {(a, i) for a in ("p0", "aggregator")
                                                                        for i in kept}
    assert all(e.group_size == 4 and e.reward == 1.0 for e in result.experiences)


async def test_a_group_left_with_fewer_than_two_episodes_is_given_up() -> None:
    result = await play_group({"p0": ["RAISE", "RAISE", "7", "RAISE"], "aggregator": ["7"] * 4}, 4)
    assert result.given_up and not result.ok and not result.experiences and not result.errors
    assert len(result.failed_episodes) == 3


async def test_a_failure_that_is_not_the_rewards_fails_the_whole_task_as_before() -> None:
    # One engine error among reward failures: the task fails (and is re-issued); nothing is dropped or kept.
    result = await play_group({"p0": ["RAISE", "ENGINE", "7", "7"], "aggregator": ["7"] * 4}, 4, Failing)
    assert not result.ok and not result.given_up and not result.experiences and not result.failed_episodes
    assert [e.error_type for e in result.errors] == ["Unavailable"]


async def test_a_task_without_a_field_a_template_names_fails_the_episode_naming_it() -> None:
    env = SolverVerifier(**config())
    env.tasks = ({"problem": "1+1", "answer": 2},)  # as a dataset row that lacks the field would arrive
    result, _, _ = await play(env, Scripted({"solver": ["2"], "verifier": ["ACCEPT"]}))
    assert "prompts.solve: the task has no field 'question' (it has answer, problem)" in result.errors[0].message


def test_tasks_are_a_seeded_shuffle_per_epoch() -> None:
    rows = [{"question": str(i), "answer": i} for i in range(5)]
    env = SolverVerifier(**config(tasks=rows, eval_tasks=rows[:2]))
    epoch0 = [env.task(i, seed=3).data["answer"] for i in range(5)]
    epoch1 = [env.task(i, seed=3).data["answer"] for i in range(5, 10)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(5)) and epoch0 != list(range(5))
    assert epoch0 == [env.task(i, seed=3).data["answer"] for i in range(5)]  # deterministic
    assert [env.eval_task(i, seed=3).data["answer"] for i in range(2)] == [0, 1] and env.held_out_tasks() == 2
    with pytest.raises(InvalidArgument, match="held-out task 2: eval_tasks has 2 rows"):
        env.eval_task(2, seed=3)
    assert env.required_fields == {"question": "prompts.solve", "answer": "reward.field"}


@pytest.mark.parametrize(("entrypoint", "cfg", "problem"), [
    ("SolverVerifier", {"rewards": {"solver": {"function": "exact"}}},
     "rewards.solver.function: unknown reward 'exact': one of exact_match, numeric_match, multiple_choice, "
     "math_equiv or 'module:function'"),
    ("SolverVerifier", {"reward": {"function": "no_such_module:f"}},
     "reward.function: cannot load reward function 'no_such_module:f'"),
    ("SolverVerifier", {"reward": {"function": "numeric_match", "feild": "answer"}},
     "reward.feild: Extra inputs are not permitted"),
    ("SolverVerifier", {"rewards": {"judge": NUMERIC}}, "rewards.judge: not a role of this workflow (roles: solver, "
                                                        "verifier)"),
    ("SolverVerifier", {"prompts": {"solve": "{questoin}"}},
     "prompts.solve: names field 'questoin', which tasks[0] lacks (it has answer, question)"),
    ("SolverVerifier", {"prompts": {"solver": "{question}"}},
     "prompts.solver: not a prompt of this workflow (it has solve, verify, revise)"),
    ("SolverVerifier", {"prompts": {"solve": "\\boxed{} {question}"}}, "prompts.solve: {} is not a field name"),
    ("SolverVerifier", {"prompts": {"solve": "{question"}}, "prompts.solve: expected '}' before end of string"),
    ("SolverVerifier", {"rounds": 0}, "rounds: Input should be greater than or equal to 1"),
    ("SolverVerifier", {"solver": "x", "verifier": "x"}, "solver and verifier must be different agents"),
    ("SolverVerifier", {"tasks": [{"question": "q"}]}, "reward.field: names field 'answer', which tasks[0] lacks"),
    ("Debate", {"debaters": ["a"]}, "debaters: List should have at least 2 items"),
    ("Debate", {"debaters": ["a", "b"], "judge": "a"}, "debaters and judge must be distinct"),
    ("Chain", {"steps": [{"agent": "a", "prompt": "{previous}"}, {"agent": "b", "prompt": "{previous}"}]},
     "steps[0].prompt: the first step has no {previous} output to read"),
    ("Chain", {"steps": [{"agent": "a", "prompt": "{question}"}, {"agent": "b"}]}, "steps[1].prompt: Field required"),
    ("Chain", {"steps": [{"agent": "a", "prompt": "{question}"}, {"agent": "b", "prompt": "{previous} {hint}"}]},
     "steps[1].prompt: names field 'hint', which tasks[0] lacks"),
    ("Mixture", {"proposers": ["a"], "aggregator": "a"}, "proposers and aggregator must be distinct"),
    ("Mixture", {"proposers": "p0"}, "proposers: Input should be a valid list"),
    ("Mixture", {"success_threshold": "1"}, "success_threshold: Input should be a valid number"),
    ("Mixture", {"tasks": []}, "tasks: List should have at least 1 item"),
    ("Mixture", {"reward_timeout_s": 0}, "reward_timeout_s: Input should be greater than 0"),
    ("Mixture", {"tasks": [ROW, {"question": "q"}]}, "reward.field: names field 'answer', which tasks[1] lacks"),
])
def test_bad_config_is_refused_in_one_line_naming_the_key(entrypoint: str, cfg: dict[str, Any], problem: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        load_environment(f"flexmarl.workflows:{entrypoint}", {"reward": NUMERIC, "tasks": [ROW], **cfg})
    message = str(refused.value)
    assert problem in message and "\n" not in message, message


def test_the_agents_come_from_the_config() -> None:
    env = load_environment("flexmarl.workflows:Debate", {"reward": NUMERIC, "debaters": ["x", "y", "z"], "judge": "j"})
    assert env.agents == ("x", "y", "z", "j")
    assert load_environment("flexmarl.workflows:SolverVerifier", {"reward": NUMERIC}).agents == ("solver", "verifier")
    chain = load_environment("flexmarl.workflows:Chain", {"reward": NUMERIC, "steps": [
        {"agent": "a", "prompt": "{question}"}, {"agent": "b", "prompt": "{previous}"},
        {"agent": "a", "prompt": "{previous}"}]})
    assert chain.agents == ("a", "b")


def arithmetic_job() -> dict[str, Any]:
    """examples/arithmetic's job (agents solver and verifier) without its warm starts."""
    spec: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples" / "arithmetic" / "job.yaml").read_text())
    for agent in spec["agents"]:
        agent.pop("warm_start")
    return spec


WORD_PROBLEMS = REPO_ROOT / "examples" / "word_problems"


def test_the_preflight_checks_the_fields_the_workflow_reads_against_the_dataset(tmp_path: Path) -> None:
    spec = arithmetic_job()
    dataset = {"train": str(WORD_PROBLEMS / "train.jsonl"), "eval": str(WORD_PROBLEMS / "eval.jsonl")}
    spec["environment"] = {"entrypoint": "flexmarl.workflows:SolverVerifier", "dataset": dataset,
                           "config": {"reward": NUMERIC}}
    assert preflight_problems(parse_job_spec(spec)) == []
    spec["environment"]["config"] = {"reward": {"function": "multiple_choice", "field": "label"},
                                     "prompts": {"solve": "{questoin} {choices}"}}
    train = dataset["train"]
    assert preflight_problems(parse_job_spec(spec)) == [
        f"environment.config.prompts.solve: names field 'questoin', which the rows of {train} lack (they have "
        "answer, choices, expression, id, label, operation, question)",
        f"environment.config.prompts.solve: names field 'questoin', which the rows of {dataset['eval']} lack (they "
        "have answer, choices, expression, held_out, id, label, operation, question)"]
    rows = [json.loads(line) for line in Path(train).read_text().splitlines()[:5]]
    del rows[3]["answer"]
    partial = tmp_path / "train.jsonl"
    partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
    spec["environment"]["dataset"] = {"train": str(partial)}
    spec["environment"]["config"] = {"reward": NUMERIC}
    assert preflight_problems(parse_job_spec(spec)) == [
        f"environment.config.reward.field: names field 'answer', which 1 rows of {partial} lack (the first: row 3, "
        "counting from 0)"]
    spec["environment"]["config"] = {"reward": NUMERIC, "tasks": [ROW]}
    assert preflight_problems(parse_job_spec(spec)) == [
        "environment.config.tasks: the job reads its tasks from environment.dataset; give one task source"]
    del spec["environment"]["dataset"]
    spec["environment"]["config"] = {"reward": NUMERIC}
    assert preflight_problems(parse_job_spec(spec)) == [
        "environment.dataset: workflow 'flexmarl.workflows:SolverVerifier' has no tasks: give environment.dataset "
        "(or rows in environment.config.tasks)"]


async def test_a_workflow_plays_the_dataset_rows() -> None:
    spec = arithmetic_job()
    spec["environment"] = {"entrypoint": "flexmarl.workflows:SolverVerifier", "config": {"reward": NUMERIC},
                           "dataset": {"train": str(WORD_PROBLEMS / "train.jsonl"),
                                       "eval": str(WORD_PROBLEMS / "eval.jsonl"), "fields": ["question", "answer"]}}
    job = parse_job_spec(spec)
    assert job.environment.dataset is not None
    env = load_environment(job.environment.entrypoint, job.environment.config, open_dataset(job.environment.dataset))
    assert isinstance(env, Workflow)
    row = env.task(5, seed=0).data
    assert env.dataset is not None and row == env.dataset.train_row(5, 0)
    held_out = env.eval_task(0, seed=0).data
    assert held_out["id"] == "wp-eval-0" and env.held_out_tasks() == 100
    backend = Scripted({"solver": [f"Answer: {row['answer']}"], "verifier": ["ACCEPT"]})
    runtimes = {agent: AgentRuntime(ContentBytes(), {}) for agent in env.agents}
    result = await RolloutRunner(env, runtimes, backend, coalesce_first_turn=False).run(
        RolloutTaskInput("job", "job/0/5", 5, 0, 1))
    await env.aclose()
    assert result.ok and row["question"] in backend.prompts("solver")[0]
    assert {(e.agent, e.reward) for e in result.experiences} == {("solver", 1.0), ("verifier", 1.0)}


def test_the_preflight_refuses_a_misspelt_key_and_accepts_agents_from_the_config() -> None:
    spec = arithmetic_job()
    spec["environment"] = {"entrypoint": "flexmarl.workflows:SolverVerifier",
                           "config": {"reward": NUMERIC, "tasks": [ROW], "round": 2}}
    assert preflight_problems(parse_job_spec(spec)) == [
        "environment.config.round: not a parameter of 'flexmarl.workflows:SolverVerifier' (it takes reward, rewards, "
        "tasks, eval_tasks, chat, system, success_threshold, reward_timeout_s, reward_workers, prompts, solver, "
        "verifier, rounds, accept_word, reject_word, accept_weight)"]
    spec["environment"]["config"] = {"reward": NUMERIC, "tasks": [ROW], "solver": "alice"}
    assert preflight_problems(parse_job_spec(spec)) == [
        "agents: environment 'flexmarl.workflows:SolverVerifier' plays agents ['alice', 'verifier']; the job has none "
        "named ['alice']",
        "agents[0].name: 'solver' is not an agent of environment 'flexmarl.workflows:SolverVerifier' (it plays "
        "['alice', 'verifier'])"]
    spec["agents"][0]["name"] = "alice"
    assert preflight_problems(parse_job_spec(spec)) == []
    spec["environment"]["config"]["reward"] = {"function": "numeric"}
    (problem,) = preflight_problems(parse_job_spec(spec))
    assert problem.startswith("environment.config: ") and "reward.function: unknown reward 'numeric'" in problem


def test_the_word_problem_warm_start_teaches_the_workflow_prompts() -> None:
    """examples/word_problems/warm_start.py: the workflow's own prompts over train rows, answered with the digits."""
    from examples.word_problems.warm_start import answer_examples

    train = {row["question"]: row for row in map(json.loads, (WORD_PROBLEMS / "train.jsonl").read_text().splitlines())}
    pairs = answer_examples(0, prompt="{question} Answer:", others=["debater_1"],
                            followup_prompt="{question} You: {previous} Others: {others} Answer:")
    for _ in range(50):
        (first, answer), (followup, again) = next(pairs), next(pairs)
        question = first.removesuffix(" Answer:")
        assert answer == again == str(train[question]["answer"])  # a train row, never a held-out one
        shown = followup.removeprefix(f"{question} You: ").removesuffix(" Answer:")
        previous, others = shown.split(" Others: [debater_1] ")
        assert all(abs(int(n) - int(answer)) <= 2 for n in (previous, others))


def test_the_word_problem_judge_warm_start_answers_whatever_the_debaters_said() -> None:
    """warm_start.judge_examples: the judge prompt over train rows with both debaters' answers, answered right."""
    from examples.word_problems.warm_start import judge_examples

    train = {row["question"]: row for row in map(json.loads, (WORD_PROBLEMS / "train.jsonl").read_text().splitlines())}
    pairs = judge_examples(0, prompt="{question} Answers: {answers} Answer:", debaters=("debater_0", "debater_1"))
    shown_right = []
    for _ in range(200):
        prompt, answer = next(pairs)
        question, listed = prompt.removesuffix(" Answer:").split(" Answers: ")
        assert answer == str(train[question]["answer"])  # a train row, never a held-out one
        first, second = listed.split("\n\n")
        assert first.startswith("[debater_0] ") and second.startswith("[debater_1] ")
        shown = [int(text.split("] ")[1]) for text in (first, second)]
        assert all(abs(n - int(answer)) <= 2 for n in shown)
        shown_right += [n == int(answer) for n in shown]
    assert 160 <= sum(shown_right) <= 240  # each debater's answer right about half the time, near misses else


def test_the_word_problem_verdict_warm_start_accepts_right_answers_and_rejects_near_misses() -> None:
    """warm_start.verdict_examples: the verify prompt over train rows, ``y`` for the answer, ``n`` for a near miss."""
    from examples.word_problems.warm_start import verdict_examples

    train = {row["question"]: row for row in map(json.loads, (WORD_PROBLEMS / "train.jsonl").read_text().splitlines())}
    pairs = verdict_examples(0, prompt="{question} Answer: {attempt} Right?")
    verdicts = []
    for _ in range(200):
        prompt, verdict = next(pairs)
        question, shown = prompt.removesuffix(" Right?").split(" Answer: ")
        answer = train[question]["answer"]  # a train row, never a held-out one
        assert verdict == ("y" if int(shown) == answer else "n")
        assert 0 <= int(shown) <= 9 and abs(int(shown) - answer) <= 3
        verdicts.append(verdict)
    assert 80 <= verdicts.count("y") <= 120  # about as many of each
