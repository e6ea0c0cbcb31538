"""The episode API that users write environments against (``from flexmarl import Environment, ...``).

It lives in the SDK so that an environment, like the preflight that checks it before submit,
depends on ``flexmarl`` only; rolloutd runs it (rolloutd/runner.py) and loads the agents'
tokenizers (rolloutd/tokenizers.py). A guide: docs/environments.md.

An environment lists its agents, declares its config as keyword parameters (so the preflight
refuses a misspelt ``environment.config`` key before submit), produces deterministic tasks
from a seeded stream (or takes them from the job's task files, ``environment.dataset``, with
no task code: :mod:`flexmarl.datasets`) and plays one episode at a time. A game two tiny
random-init models learn (examples/signaling/env.py is the full one)::

    class Game(Environment):
        agents = ("sender", "receiver")

        def __init__(self, *, num_objects: int = 2) -> None:
            super().__init__(num_objects=num_objects)
            self.num_objects = num_objects

        def task(self, index: int, seed: int) -> Task:
            return Task(index=index, seed=seed, data={"target": task_rng(index, seed).randrange(self.num_objects)})

        async def episode(self, ctx: EpisodeContext, task: Task) -> None:
            target = task.data["target"]
            msg = await ctx.generate("sender", "abcdefghij"[target], max_new_tokens=1)
            answer = await ctx.generate("receiver", ctx.tokenize("receiver", ">") + list(msg.token_ids),
                                        max_new_tokens=1)
            # Any answer token names a position (id mod K): an untrained pair scores chance, 1/K,
            # so every group has reward variance from step one (an exact "2" would be hit ~1 in 300).
            won = bool(answer.token_ids) and answer.token_ids[0] % self.num_objects == target
            for agent in self.agents:  # both agents learn from the shared outcome
                ctx.reward(agent, 1.0 if won else 0.0)

``ctx.generate`` takes chat messages (rendered with the agent's tokenizer's chat template and
a generation prompt), a plain string (tokenized without a template) or token ids. Every call
is one *turn* of that agent and becomes one training experience. ``ctx.generate_n`` samples
``n`` responses to one prompt in one backend request (SGLang's ``n``; seeded sampling gives
sample ``i`` the seed ``seed + i``, so the samples differ and stay reproducible); each is a
turn of its own (turns ``t .. t + n - 1``, one prompt).

Rewards: ``ctx.reward(agent, value)`` is an episode-level reward, counted at the agent's last
turn; ``ctx.reward(agent, value, turn=k)`` rewards the agent's turn ``k`` (``-1``: its latest
turn so far). The runner gives each turn of an agent its *return*: the agent's rewards from
that turn on, the one ``j`` turns later discounted by ``gamma**j`` (the agent's
``algorithm.gamma``, default 1), after :meth:`Environment.shape_reward` has seen each turn's
reward. With episode-level rewards and ``gamma: 1`` every turn of the agent gets the sum of its
rewards (the episode return), and GRPO normalises it within the task's group. An exception
raised by user code fails the episode (recorded, never raised out of the runner); the runner
then fails the whole group.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

from flexmarl.entrypoints import load_entrypoint
from flexmarl.errors import DataLoss, InvalidArgument

if TYPE_CHECKING:
    from flexmarl.datasets import TaskDataset

ChatMessage: TypeAlias = Mapping[str, str]
"""A chat message: {"role": "system" | "user" | "assistant", "content": str}."""

PromptInput: TypeAlias = Sequence[ChatMessage] | Sequence[int] | str

SAMPLING_KEYS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_new_tokens",
        "min_new_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    }
)
"""Sampling parameters an episode may override (SGLang's names; ``n`` is ``generate_n``'s argument)."""

TOP_LOGPROBS_KEY = "top_logprobs_num"
"""The one request option the sampling dict carries besides sampling parameters: SGLang's
``top_logprobs_num`` (a /generate field, not a sampling parameter), set by ``generate``'s
``top_logprobs_num`` and taken out again by rolloutd/router.py before the sampling parameters
go to the engine."""

TopLogprobs: TypeAlias = tuple[tuple[tuple[float, int], ...], ...]
"""Per response token, its most likely alternatives as (logprob, token id), most likely first."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One environment task; ``data`` is the environment's own JSON-like payload."""

    index: int
    seed: int
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def task_rng(index: int, seed: int) -> random.Random:
    """The seeded random stream of task ``index`` of a job with ``seed`` (process independent)."""
    return random.Random(f"flexmarl-task/{seed}/{index}")


def held_out_seed(seed: int) -> int:
    """The seed of a job's held-out task stream: ``Environment.eval_task`` draws from it by default.

    A different stream from the training one (``task_rng(index, seed)``), derived from the job
    seed alone so that every evaluation of a job sees the same tasks.
    """
    return random.Random(f"flexmarl-held-out/{seed}").randrange(2**63)


def episode_rng(seed: int, task_index: int, sample_index: int) -> random.Random:
    """The seeded random stream of one episode (``ctx.rng``)."""
    return random.Random(f"flexmarl-episode/{seed}/{task_index}/{sample_index}")


@dataclasses.dataclass(frozen=True)
class Generation:
    """What ``ctx.generate`` returns: one sampled response."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_token_ids: tuple[int, ...]
    finish_reason: str
    version: int
    #: With ``generate``'s ``top_logprobs_num`` k: the k most likely tokens at every response position.
    top_logprobs: TopLogprobs = ()


@dataclasses.dataclass(frozen=True)
class TurnRecord:
    """One agent turn of an episode: the raw material of one experience."""

    agent: str
    turn: int
    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...]
    behavior_version: int
    #: (start, version) spans of the response tokens (see :class:`GenerationOutput`); empty: all behavior_version.
    version_spans: tuple[tuple[int, int], ...] = ()
    #: Assistant messages of the prompt re-tokenized from text (``generate``'s ``retokenized_messages``).
    retokenized_messages: int = 0


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
    """What :meth:`Environment.shape_reward` sees of the episode a turn belongs to."""

    sample_index: int
    #: Every agent's turns, in completion order (``turn.agent`` and ``turn.turn`` say whose and which).
    turns: tuple[TurnRecord, ...]
    #: Each agent's episode return: the unshaped sum of its rewards (what the orchestrator reports).
    returns: Mapping[str, float]
    #: What the episode left in ``ctx.notes`` (a receiver's probability of the target, say).
    notes: Mapping[str, Any]

    def turns_of(self, agent: str) -> tuple[TurnRecord, ...]:
        """``agent``'s turns, in turn order."""
        return tuple(sorted((t for t in self.turns if t.agent == agent), key=lambda t: t.turn))


@dataclasses.dataclass(frozen=True)
class TurnRequest:
    """A fully resolved generation request (ids + merged sampling parameters)."""

    agent: str
    input_ids: tuple[int, ...]
    sampling: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    """One sampled response as a generation backend returns it.

    ``logprobs[i]`` is the behaviour policy's log-probability of ``token_ids[i]``; ``version``
    is the policy version of the agent that produced the oldest token. ``version_spans`` are
    ``(start, version)`` pairs, ascending in ``start`` (the first at 0): token ``i`` was
    sampled with the version of the last span starting at or before ``i``. Empty: every
    token has ``version`` (a generation that no new version interrupted).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    version: int
    version_spans: tuple[tuple[int, int], ...] = ()
    #: The engine's ``output_top_logprobs`` when the request asked for them (never trained on).
    top_logprobs: TopLogprobs = ()


class AgentTokenizer(Protocol):
    """What an episode needs from an agent's tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, without special tokens."""
        ...

    def render_chat(self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None = None,
                    ) -> list[int]:
        """Token ids of messages under the chat template, with the generation prompt.

        ``tools`` (OpenAI function definitions) are handed to the template; a tokenizer whose
        template cannot render them raises ``InvalidArgument``. Callers pass ``tools`` only when
        there are some, so a tokenizer without tool support may omit the parameter.
        """
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens skipped."""
        ...


Sampler = Callable[[int, TurnRequest], Awaitable[GenerationOutput]]
"""The runner's hook: (sample_index, request) -> response."""

MultiSampler = Callable[[int, TurnRequest, int], Awaitable[Sequence[GenerationOutput]]]
"""The runner's hook for ``generate_n``: (sample_index, request, n) -> n responses, in sample order."""


class EpisodeContext:
    """The handle an episode uses to generate and to reward; one per episode."""

    def __init__(
        self,
        *,
        agents: Mapping[str, AgentTokenizer],
        sampling_defaults: Mapping[str, Mapping[str, Any]],
        sample_index: int,
        rng: random.Random,
        sampler: Sampler,
        multi_sampler: MultiSampler | None = None,
    ) -> None:
        self._tokenizers = agents
        self._sampling_defaults = sampling_defaults
        self._sampler = sampler
        self._multi_sampler = multi_sampler
        self.sample_index = sample_index
        self.rng = rng
        self._turns: list[TurnRecord] = []
        self._next_turn: dict[str, int] = dict.fromkeys(agents, 0)
        self._returns: dict[str, float] = dict.fromkeys(agents, 0.0)
        self._turn_rewards: dict[str, dict[int, float]] = {agent: {} for agent in agents}
        self._episode_rewards: dict[str, float] = dict.fromkeys(agents, 0.0)
        #: The episode's own notes for :meth:`Environment.shape_reward` (``EpisodeRecord.notes``).
        self.notes: dict[str, Any] = {}

    @property
    def agents(self) -> tuple[str, ...]:
        """The agents of this episode."""
        return tuple(self._tokenizers)

    def tokenize(self, agent: str, prompt: PromptInput, *, tools: Sequence[Mapping[str, Any]] | None = None,
                 ) -> list[int]:
        """Token ids of a prompt as ``generate`` would send it (``tools``: given to the chat template)."""
        tokenizer = self._tokenizer(agent)
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        items: list[object] = list(prompt)
        if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
            return [int(item) for item in items if isinstance(item, int)]
        messages = [item for item in items if isinstance(item, Mapping)]
        if len(messages) == len(items):
            for message in messages:
                if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                    raise InvalidArgument("a chat message needs string 'role' and 'content'")
            return tokenizer.render_chat(messages, tools=tools) if tools else tokenizer.render_chat(messages)
        if tools:
            raise InvalidArgument("tools apply to chat messages only")
        raise InvalidArgument("prompt must be a string, chat messages or token ids")

    async def generate(self, agent: str, prompt: PromptInput, *, retokenized_messages: int = 0,
                       top_logprobs_num: int = 0, **sampling_overrides: Any) -> Generation:
        """Samples one response of ``agent``; records the turn.

        Args:
            agent: one of the environment's agents.
            prompt: chat messages (chat template applied), a string (no template) or token ids.
            retokenized_messages: recorded with the turn: how many earlier assistant messages in
                ``prompt`` are a re-tokenization of their text rather than the sampled ids (the
                OpenAI gateway says so; native episodes leave it 0).
            top_logprobs_num: SGLang's ``top_logprobs_num``: the k most likely tokens at every
                response position come back in ``Generation.top_logprobs`` (not recorded: the
                sampled token's logprob is what trains).
            **sampling_overrides: SGLang sampling parameters overriding the job's defaults.

        Returns:
            The response text, token ids, logprobs and the policy version that produced it.
        """
        request = self._request(agent, prompt, sampling_overrides, top_logprobs_num)
        turn = self._next_turn[agent]
        self._next_turn[agent] = turn + 1
        response = await self._sampler(self.sample_index, request)
        self._check(agent, response, request)
        self._record(agent, turn, request, response, retokenized_messages)
        return self._generation(agent, request, response)

    async def generate_n(self, agent: str, prompt: PromptInput, n: int, *, retokenized_messages: int = 0,
                         top_logprobs_num: int = 0, **sampling_overrides: Any) -> list[Generation]:
        """Samples ``n`` responses of ``agent`` to one prompt in one backend request; records ``n`` turns.

        The samples are turns ``t .. t + n - 1`` of the agent, in sample order, all with the
        prompt's ids (and, like every turn, the agent's episode return as reward). Seeded
        sampling gives sample ``i`` the request's seed plus ``i`` (rolloutd/router.py), so the
        samples differ and a rerun draws the same ones. The request never joins the runner's
        first-turn coalescing. ``n == 1`` is :meth:`generate`.

        Args:
            agent: one of the environment's agents.
            prompt: chat messages (chat template applied), a string (no template) or token ids.
            n: how many samples (>= 1).
            retokenized_messages: recorded with every sample's turn (see :meth:`generate`).
            top_logprobs_num: top logprobs of every sample (see :meth:`generate`).
            **sampling_overrides: SGLang sampling parameters overriding the job's defaults.

        Returns:
            The ``n`` generations, in sample order.

        Raises:
            InvalidArgument: ``n`` is not a positive integer, or this context cannot sample ``n`` > 1.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"n must be a positive integer, got {n!r}")
        if n == 1:
            return [await self.generate(agent, prompt, retokenized_messages=retokenized_messages,
                                        top_logprobs_num=top_logprobs_num, **sampling_overrides)]
        if self._multi_sampler is None:
            raise InvalidArgument("this episode context cannot sample n > 1 in one request")
        request = self._request(agent, prompt, sampling_overrides, top_logprobs_num)
        first = self._next_turn[agent]
        self._next_turn[agent] = first + n
        responses = list(await self._multi_sampler(self.sample_index, request, n))
        if len(responses) != n:
            raise DataLoss(f"{agent}: {len(responses)} samples for n={n}")
        for response in responses:
            self._check(agent, response, request)
        for i, response in enumerate(responses):
            self._record(agent, first + i, request, response, retokenized_messages)
        return [self._generation(agent, request, response) for response in responses]

    def _request(self, agent: str, prompt: PromptInput, sampling_overrides: Mapping[str, Any],
                 top_logprobs_num: int = 0) -> TurnRequest:
        unknown = set(sampling_overrides) - SAMPLING_KEYS
        if unknown:
            raise InvalidArgument(f"unknown sampling parameters {sorted(unknown)}")
        if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise InvalidArgument(f"top_logprobs_num must be a non-negative integer, got {top_logprobs_num!r}")
        if top_logprobs_num:
            sampling_overrides = {**sampling_overrides, TOP_LOGPROBS_KEY: top_logprobs_num}
        input_ids = self.tokenize(agent, prompt)
        if not input_ids:
            raise InvalidArgument(f"empty prompt for agent {agent!r}")
        return TurnRequest(agent, tuple(input_ids), {**self._sampling_defaults.get(agent, {}), **sampling_overrides})

    @staticmethod
    def _check(agent: str, response: GenerationOutput, request: TurnRequest | None = None) -> None:
        if len(response.logprobs) != len(response.token_ids):
            raise DataLoss(f"{agent}: {len(response.logprobs)} logprobs for {len(response.token_ids)} response tokens")
        if request is not None and request.sampling.get(TOP_LOGPROBS_KEY) and len(response.top_logprobs) != len(
                response.token_ids):
            raise DataLoss(f"{agent}: top logprobs for {len(response.top_logprobs)} of {len(response.token_ids)} "
                           "response tokens (the backend did not serve top_logprobs_num)")

    def _record(self, agent: str, turn: int, request: TurnRequest, response: GenerationOutput,
                retokenized_messages: int = 0) -> None:
        self._turns.append(
            TurnRecord(agent, turn, request.input_ids, response.token_ids, response.logprobs, response.version,
                       response.version_spans, retokenized_messages)
        )

    def _generation(self, agent: str, request: TurnRequest, response: GenerationOutput) -> Generation:
        return Generation(
            text=self._tokenizer(agent).decode(response.token_ids),
            token_ids=response.token_ids,
            logprobs=response.logprobs,
            prompt_token_ids=request.input_ids,
            finish_reason=response.finish_reason,
            version=response.version,
            top_logprobs=response.top_logprobs,
        )

    def decode(self, agent: str, token_ids: Sequence[int]) -> str:
        """Text of ``agent``'s token ids, special tokens skipped (as ``generate`` decodes its text)."""
        return self._tokenizer(agent).decode(token_ids)

    def sampling_defaults(self, agent: str) -> dict[str, Any]:
        """The job's sampling parameters of ``agent`` (what ``generate`` merges its overrides into)."""
        self._tokenizer(agent)
        return dict(self._sampling_defaults.get(agent, {}))

    def reward(self, agent: str, value: float, *, turn: int | None = None) -> None:
        """Rewards ``agent``: the episode (``turn`` None: counted at its last turn) or its turn ``turn``.

        Args:
            agent: one of the environment's agents.
            value: a finite number; rewards add up.
            turn: the agent's turn index (``0`` its first), negative counting back from its latest
                turn so far (``-1``); None: an episode-level reward.

        Raises:
            InvalidArgument: unknown agent, a non-finite value, or a turn the agent has not taken.
        """
        self._tokenizer(agent)
        reward = float(value)
        if not math.isfinite(reward):
            raise InvalidArgument(f"reward for {agent!r} must be finite, got {value!r}")
        if turn is not None:
            taken = self._next_turn[agent]
            index = turn + taken if turn < 0 else turn
            if isinstance(turn, bool) or not 0 <= index < taken:
                raise InvalidArgument(f"reward for {agent!r}: turn {turn!r} not taken ({taken} turns so far)")
            by_turn = self._turn_rewards[agent]
            by_turn[index] = by_turn.get(index, 0.0) + reward
        else:
            self._episode_rewards[agent] += reward
        self._returns[agent] += reward

    def returns(self) -> dict[str, float]:
        """Each agent's episode return so far (the undiscounted sum of all its rewards)."""
        return dict(self._returns)

    def turn_rewards(self) -> dict[str, dict[int, float]]:
        """Each agent's turn-level rewards so far: turn index -> sum of the rewards given to that turn."""
        return {agent: dict(by_turn) for agent, by_turn in self._turn_rewards.items()}

    def episode_rewards(self) -> dict[str, float]:
        """Each agent's episode-level rewards so far (``reward`` without ``turn``), summed."""
        return dict(self._episode_rewards)

    def turns(self) -> list[TurnRecord]:
        """The turns recorded so far, in completion order."""
        return list(self._turns)

    def _tokenizer(self, agent: str) -> AgentTokenizer:
        tokenizer = self._tokenizers.get(agent)
        if tokenizer is None:
            raise InvalidArgument(f"unknown agent {agent!r}; the environment has {sorted(self._tokenizers)}")
        return tokenizer


class Environment(abc.ABC):
    """Base class of user environments.

    Subclasses set ``agents`` and implement :meth:`episode`, and :meth:`task` unless the job
    reads its tasks from files (``environment.dataset``: then the default ``task`` returns the
    rows, see :mod:`flexmarl.datasets`). The constructor receives the job spec's
    ``environment.config`` as keyword arguments: declare them as keyword parameters with
    defaults (``def __init__(self, *, num_objects: int = 4)``, passing them on to
    ``super().__init__`` for ``self.config``) and the preflight refuses unknown keys;
    ``**config`` takes any key unchecked.
    """

    agents: tuple[str, ...] = ()
    #: The job's task rows when it has an ``environment.dataset`` (set by :func:`load_environment` after
    #: the constructor ran, so first usable in ``task``/``episode``); None otherwise.
    dataset: TaskDataset | None = None

    def __init__(self, **config: Any) -> None:
        self.config: dict[str, Any] = dict(config)

    def task(self, index: int, seed: int) -> Task:
        """The deterministic task ``index`` of the stream seeded by ``seed`` (see task_rng).

        The default serves a job with ``environment.dataset``: ``data`` is the train row task
        ``index`` plays (a shuffled order per epoch, from ``seed``). An environment that makes
        its tasks in code overrides this.

        Raises:
            InvalidArgument: the job has no dataset and the environment does not override ``task``.
        """
        if self.dataset is None:
            raise InvalidArgument(f"{type(self).__name__} has no tasks: override task(index, seed), or give the "
                                  "job an environment.dataset")
        return Task(index=index, seed=seed, data=self.dataset.train_row(index, seed))

    def eval_task(self, index: int, seed: int) -> Task:
        """The held-out task ``index`` of a job with ``seed``: what evaluation episodes play, never trained on.

        With an eval file (``environment.dataset.eval``) ``data`` is its row ``index``, in file
        order. Otherwise the default draws :meth:`task` from the held-out stream
        (:func:`held_out_seed`), so an environment that generates its tasks gets a held-out set
        without code. Tasks a generator can repeat (two-digit sums, say) may also appear in
        training, and a dataset without an eval file gives train rows (in another order): give
        an eval file, or override this, for a real split.
        """
        if self.dataset is not None and self.dataset.eval_size is not None:
            return Task(index=index, seed=seed, data=self.dataset.eval_row(index))
        return self.task(index, held_out_seed(seed))

    def held_out_tasks(self) -> int | None:
        """How many distinct held-out tasks :meth:`eval_task` has: the eval file's rows; None: unbounded."""
        if self.dataset is not None:
            return self.dataset.eval_size
        return None

    @abc.abstractmethod
    async def episode(self, ctx: EpisodeContext, task: Task) -> None:
        """Plays one episode: ``await ctx.generate(...)`` and ``ctx.reward(...)``."""

    def shape_reward(self, task: Task, turn: TurnRecord, reward: float, *, episode: EpisodeRecord) -> float:
        """Reward shaping: the reward ``turn`` is trained with, given the reward the episode gave it.

        Called by rolloutd for every agent turn of a successful episode, before the returns are
        discounted and the experiences stored; ``reward`` is the turn's own reward plus, at the
        agent's last turn, its episode-level rewards. ``episode`` is the whole episode: every
        agent's turns, the unshaped returns and ``ctx.notes``, so a speaker's turn can be shaped
        by what its listener did. The default changes nothing. A potential-based shaping
        (``reward + gamma * phi(next) - phi(this)``) keeps the optimal policies; anything else
        changes what is learned. What the orchestrator reports as the episode return stays the
        unshaped sum. An override written without ``episode`` (``task, turn, reward``) is still
        called, without it (:func:`reward_shaper`).
        """
        return reward

    async def aclose(self) -> None:  # noqa: B027 - an optional hook, not an abstract method
        """Releases what the environment holds across episodes (a server, say); the default holds nothing."""


def reward_shaper(env: Environment) -> Callable[[Task, TurnRecord, float, EpisodeRecord], float]:
    """``env.shape_reward`` as a runner calls it: with the episode, unless the override takes no ``episode``.

    Environments written when ``shape_reward`` had three parameters keep working; the signature
    is read once, here, not at every turn.
    """
    shape = env.shape_reward
    try:
        parameters = inspect.signature(shape).parameters.values()
    except (TypeError, ValueError):  # a callable whose signature cannot be read: the current contract
        return lambda task, turn, reward, episode: shape(task, turn, reward, episode=episode)
    if any(p.name == "episode" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return lambda task, turn, reward, episode: shape(task, turn, reward, episode=episode)
    legacy = cast(Callable[[Task, TurnRecord, float], float], shape)
    return lambda task, turn, reward, episode: legacy(task, turn, reward)


def load_environment(entrypoint: str, config: Mapping[str, Any] | None = None,
                     dataset: TaskDataset | None = None) -> Environment:
    """Imports ``module:attr`` and builds the environment with ``config`` as kwargs.

    ``dataset`` (the job's task rows, :func:`flexmarl.datasets.open_dataset`) becomes the
    environment's ``dataset`` once it is built, so every environment, built-in or custom, gets
    the same rows.

    Raises:
        InvalidArgument: bad entrypoint, import failure (any exception user code raises while its
            module is imported or the environment built), not an Environment, or no agents.
    """
    target = load_entrypoint(entrypoint, "environment", named="environment entrypoint")
    if not (isinstance(target, type) and issubclass(target, Environment)):
        raise InvalidArgument(f"{entrypoint!r} is not an Environment subclass")
    try:
        env = target(**dict(config or {}))
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"bad config for environment {entrypoint!r}: {exc}") from exc
    except Exception as exc:
        raise InvalidArgument(f"building environment {entrypoint!r} raised {type(exc).__name__}: {exc}") from exc
    if not env.agents or len(set(env.agents)) != len(env.agents):
        raise InvalidArgument(f"environment {entrypoint!r} must list distinct agents, got {env.agents!r}")
    if dataset is not None:
        env.dataset = dataset
    return env
