from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from byte_tokenizers import RoleBytes

from flexmarl.episode import EpisodeContext, GenerationOutput, TurnRequest, episode_rng, load_environment, task_rng
from flexmarl.errors import DataLoss, InvalidArgument
from flexmarl.jobspec import load_job_spec
from flexmarl.tiny import build_tiny_tokenizer
from rolloutd.tokenizers import HFTokenizer, load_tokenizers

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # examples/ is not an installed package


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(path)
    return path


def scripted_ctx(
    replies: dict[str, list[str]], agents: Sequence[str] = ("a", "b")
) -> tuple[EpisodeContext, list[TurnRequest]]:
    seen: list[TurnRequest] = []

    async def sampler(index: int, request: TurnRequest) -> GenerationOutput:
        seen.append(request)
        ids = tuple(replies[request.agent].pop(0).encode())
        return GenerationOutput(ids, tuple(-0.5 for _ in ids), "stop", 3)

    tok = RoleBytes()
    ctx = EpisodeContext(
        agents={a: tok for a in agents},
        sampling_defaults={a: {"temperature": 1.0, "max_new_tokens": 4} for a in agents},
        sample_index=2,
        rng=random.Random(0),
        sampler=sampler,
    )
    return ctx, seen


async def test_generate_records_turns_and_merges_sampling() -> None:
    ctx, seen = scripted_ctx({"a": ["hi", "yo"], "b": ["ok"]})
    first = await ctx.generate("a", "x=")
    second = await ctx.generate("a", [{"role": "user", "content": "q"}], max_new_tokens=1)
    third = await ctx.generate("b", [5, 6, 7], temperature=0.0)
    assert (first.text, second.text, third.text) == ("hi", "yo", "ok")
    assert first.prompt_token_ids == tuple(b"x=")
    assert second.prompt_token_ids == tuple(b"user:q|assistant:")
    assert seen[1].sampling == {"temperature": 1.0, "max_new_tokens": 1}
    assert seen[2].sampling == {"temperature": 0.0, "max_new_tokens": 4}
    assert [(t.agent, t.turn) for t in ctx.turns()] == [("a", 0), ("a", 1), ("b", 0)]
    assert ctx.turns()[0].response_logprobs == (-0.5, -0.5)
    assert ctx.turns()[0].behavior_version == 3


async def test_generate_n_is_one_request_recorded_as_n_turns() -> None:
    calls: list[tuple[TurnRequest, int]] = []

    async def sampler(index: int, request: TurnRequest) -> GenerationOutput:
        return GenerationOutput(tuple(b"one"), (-0.5,) * 3, "stop", 3)

    async def multi_sampler(index: int, request: TurnRequest, n: int) -> list[GenerationOutput]:
        calls.append((request, n))
        return [GenerationOutput((97 + i, 98 + i), (-0.25, -0.5), "stop", 4 + i) for i in range(n)]

    ctx = EpisodeContext(agents={"a": RoleBytes()}, sampling_defaults={"a": {"max_new_tokens": 4}},
                         sample_index=0, rng=random.Random(0), sampler=sampler, multi_sampler=multi_sampler)
    first = await ctx.generate("a", "x")
    pair = await ctx.generate_n("a", "q=", 2, temperature=0.5)
    assert [g.text for g in pair] == ["ab", "bc"] and [g.version for g in pair] == [4, 5]
    assert calls == [(TurnRequest("a", tuple(b"q="), {"max_new_tokens": 4, "temperature": 0.5}), 2)]
    turns = ctx.turns()
    assert [t.turn for t in turns] == [0, 1, 2] and first.text == "one"
    assert turns[1].prompt_token_ids == turns[2].prompt_token_ids == tuple(b"q=")
    assert [t.response_token_ids for t in turns[1:]] == [(97, 98), (98, 99)]
    assert (await ctx.generate_n("a", "y", 1))[0].text == "one" and len(calls) == 1  # n=1 is generate
    with pytest.raises(InvalidArgument):
        await ctx.generate_n("a", "y", 0)
    no_multi, _ = scripted_ctx({"a": []})
    with pytest.raises(InvalidArgument):
        await no_multi.generate_n("a", "y", 2)


def test_hf_tokenizer_renders_tools_only_with_a_template_that_does(tokenizer_dir: Path) -> None:
    tok = HFTokenizer(str(tokenizer_dir))
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    with pytest.raises(InvalidArgument, match="does not render tools"):
        tok.render_chat([{"role": "user", "content": "hi"}], tools=tools)
    tok._tokenizer.chat_template = (  # a template that renders tools
        "{% for t in tools or [] %}tool:{{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}")
    assert tok.decode(tok.render_chat([{"role": "user", "content": "hi"}], tools=tools)) == "tool:lookup\nuser:hi\n"
    assert tok.decode(tok.render_chat([{"role": "user", "content": "hi"}])) == "user:hi\n"


async def test_rewards_sum_into_the_episode_return() -> None:
    ctx, _ = scripted_ctx({})
    ctx.reward("a", 1)
    ctx.reward("a", 0.5)
    ctx.reward("b", -1.0)
    assert ctx.returns() == {"a": 1.5, "b": -1.0}
    with pytest.raises(InvalidArgument):
        ctx.reward("a", float("nan"))
    with pytest.raises(InvalidArgument):
        ctx.reward("zed", 1.0)


async def test_generate_rejects_bad_input() -> None:
    ctx, _ = scripted_ctx({"a": ["x"]})
    with pytest.raises(InvalidArgument):
        await ctx.generate("zed", "x")
    with pytest.raises(InvalidArgument):
        await ctx.generate("a", "x", n=4)
    with pytest.raises(InvalidArgument):
        await ctx.generate("a", "")
    with pytest.raises(InvalidArgument):
        await ctx.generate("a", [{"role": "user"}])


async def test_mismatched_logprobs_are_rejected() -> None:
    async def sampler(index: int, request: TurnRequest) -> GenerationOutput:
        return GenerationOutput((1, 2), (-0.1,), "stop", 0)

    ctx = EpisodeContext(
        agents={"a": RoleBytes()}, sampling_defaults={}, sample_index=0, rng=random.Random(0), sampler=sampler
    )
    with pytest.raises(DataLoss):
        await ctx.generate("a", "x")


def test_seeded_streams_are_deterministic() -> None:
    assert task_rng(3, 7).random() == task_rng(3, 7).random()
    assert task_rng(3, 7).random() != task_rng(4, 7).random()
    assert episode_rng(7, 3, 0).random() != episode_rng(7, 3, 1).random()


def test_hf_tokenizer_renders_chat_template(tokenizer_dir: Path) -> None:
    tok = HFTokenizer(str(tokenizer_dir))
    assert tok.encode("ab") == [97, 98]
    ids = tok.render_chat([{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "user\nhi\nassistant\n"
    assert ids[0] >= 256  # <|im_start|>
    tokenizers = load_tokenizers({"a": str(tokenizer_dir), "b": str(tokenizer_dir)})
    assert tokenizers["a"] is tokenizers["b"]


def test_load_environment_errors(repo_on_path: None) -> None:
    with pytest.raises(InvalidArgument):
        load_environment("no-colon")
    with pytest.raises(InvalidArgument):
        load_environment("examples.signaling.env:Nope")
    with pytest.raises(InvalidArgument):
        load_environment("examples.signaling.env:OBJECTS")
    with pytest.raises(InvalidArgument):
        load_environment("examples.signaling.env:SignalingGame", {"bogus": 1, "num_objects": "x"})


def test_example_tasks_are_deterministic(repo_on_path: None) -> None:
    game = load_environment("examples.signaling.env:SignalingGame", {"num_objects": 4})
    assert game.agents == ("sender", "receiver")
    assert game.task(5, 0) == game.task(5, 0)
    targets = {game.task(i, 0).data["target"] for i in range(40)}
    assert targets == {0, 1, 2, 3}
    flow = load_environment("examples.workflow.env:ArithmeticWorkflow")
    task = flow.task(1, 0)
    a, b = (int(x) for x in task.data["problem"].split("+"))
    assert task.data["answer"] == a + b


async def test_signaling_episode_rewards_a_correct_answer(repo_on_path: None) -> None:
    game = load_environment("examples.signaling.env:SignalingGame")
    task = game.task(0, 0)
    target = task.data["target"]
    ctx, seen = scripted_ctx({"sender": ["Z"], "receiver": [str(target)]}, agents=game.agents)
    await game.episode(ctx, task)
    assert ctx.returns() == {"sender": 1.0, "receiver": 1.0}
    # the sender sees only the target; the receiver sees only the message (ids verbatim)
    assert bytes(seen[0].input_ids) == task.data["candidates"][target].encode()
    assert bytes(seen[1].input_ids) == b">Z"
    assert seen[0].sampling["max_new_tokens"] == 1 and seen[1].sampling["max_new_tokens"] == 1
    ctx, _ = scripted_ctx({"sender": ["Z"], "receiver": [str((target + 1) % 4)]}, agents=game.agents)
    await game.episode(ctx, task)
    assert ctx.returns() == {"sender": 0.0, "receiver": 0.0}
    # an answer token names position (token id mod K): "4" (byte 52) names position 0 for K=4
    ctx, _ = scripted_ctx({"sender": ["Z"], "receiver": [chr(ord("0") + target + 4)]}, agents=game.agents)
    await game.episode(ctx, task)
    assert ctx.returns() == {"sender": 1.0, "receiver": 1.0}


async def test_workflow_episode_rewards(repo_on_path: None) -> None:
    from examples.workflow.env import closeness, last_integer

    assert last_integer("so 3 then 12") == 12 and last_integer("none") is None
    assert closeness(12, 12) == 1.0 and closeness(7, 12) == 0.5 and closeness(None, 1) == 0.0
    flow = load_environment("examples.workflow.env:ArithmeticWorkflow")
    task = flow.task(0, 0)
    answer = task.data["answer"]
    ctx, seen = scripted_ctx(
        {"planner": ["add"], "solver": [f"sum is {answer}"], "verifier": ["Y"]}, agents=flow.agents
    )
    await flow.episode(ctx, task)
    assert ctx.returns() == {"planner": 1.0, "solver": 1.0, "verifier": 1.0}
    assert [r.sampling["max_new_tokens"] for r in seen] == [4, 40, 1]


def test_example_job_specs_validate() -> None:
    for name in ("signaling/job.yaml", "workflow/job.yaml", "gpu/signaling.yaml", "gpu/workflow.yaml"):
        spec = load_job_spec(REPO_ROOT / "examples" / name)
        assert spec.environment.entrypoint.startswith("examples.")
