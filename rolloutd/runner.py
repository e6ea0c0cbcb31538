"""Runs one rollout task: ``group_size`` episodes of one environment task, concurrently.

The first generation request of every episode goes through a :class:`FirstTurnCoalescer`:
it waits until each of the n episodes has either made its first request or ended without
one, then sends each set of identical requests (same agent, prompt ids and sampling
parameters) once with SGLang's ``n`` so the shared prefix is computed once. The grouping
and the order in which samples are handed back (sample index order) are deterministic. Only
an episode's *first* request waits, so the barrier cannot deadlock: nothing else is pending
in an episode before its first request. Later turns go straight to the backend, and so does
an episode's ``generate_n`` (n > 1) call, even a first one: that episode leaves the barrier
(as one that ended without a request) and its n-request is sent as the episode asked.

Every request carries an affinity key (:func:`rolloutd.balancer.episode_affinity_key`, or
the group key for a coalesced request) so the balancer keeps an episode's turns on the
replica that holds its KV prefix.

An episode whose reward fails (:class:`flexmarl.rewards.RewardFailed`: the reward function
raised, ran past its time limit or gave no finite number) is dropped with its reason, and the
group's other episodes play on: the result carries their experiences and the dropped episodes
(:class:`flexmarl.experience.FailedEpisode`), or, when fewer than
:func:`flexmarl.experience.min_episodes_to_train` are left, no experiences and ``given_up``
(orchestratord gives the task up instead of re-issuing it). Any other failure (an exception in
user code or in the backend) fails the whole group: the result carries the errors and no
experiences, and the orchestrator re-issues the task.

:meth:`RolloutRunner.evaluate` plays a held-out evaluation task the same way
(``Environment.eval_task``; greedy: every turn at temperature 0) and returns each episode's
outcome (:class:`flexmarl.evaluation.EvalEpisode`) instead of experiences.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from flexmarl.episode import (
    AgentTokenizer,
    Environment,
    EpisodeContext,
    EpisodeRecord,
    GenerationOutput,
    TurnRecord,
    TurnRequest,
    episode_rng,
    reward_shaper,
)
from flexmarl.errors import DataLoss, InvalidArgument
from flexmarl.evaluation import EvalEpisode, role_correct_note, team_success_note
from flexmarl.experience import (
    ExperienceRecord,
    FailedEpisode,
    experience_id,
    group_id,
    min_episodes_to_train,
    version_spans_array,
)
from flexmarl.rewards import RewardFailed
from rolloutd.balancer import episode_affinity_key, group_affinity_key

logger = logging.getLogger(__name__)

__all__ = [
    "AgentRuntime",
    "EpisodeError",
    "EvaluationResult",
    "FirstTurnCoalescer",
    "GenerationBackend",
    "GenerationOutput",
    "RolloutResult",
    "RolloutRunner",
    "RolloutTaskInput",
]


class GenerationBackend(Protocol):
    """Agent-level generation: routes to a replica of ``agent`` and samples ``n`` responses.

    ``sampling`` uses SGLang's ``sampling_params`` names without ``n``. Implementations
    return exactly ``n`` outputs in order and raise a ``FlexmarlError`` on failure.
    """

    async def generate(
        self, agent: str, input_ids: list[int], sampling: dict[str, Any], n: int, affinity_key: str
    ) -> list[GenerationOutput]:
        """Samples n responses to ``input_ids`` with ``agent``'s current policy."""
        ...


@dataclasses.dataclass(frozen=True)
class AgentRuntime:
    """What the runner needs per agent: its tokenizer, default sampling parameters and return discount."""

    tokenizer: AgentTokenizer
    sampling: Mapping[str, Any]
    #: ``algorithm.gamma`` of the agent: a turn's return discounts the reward j turns later by gamma**j.
    gamma: float = 1.0


@dataclasses.dataclass
class TaskProgress:
    """Work done on one task so far: tokens generated plus one per answered generation call (only grows).

    The figure a lease renewal carries: orchestratord stops renewing a task whose figure stands
    still for longer than the job's ``leases.progress_timeout_s`` (a hung engine).
    """

    units: int = 0
    #: While set, every renewal counts as progress: the task waits for its job's set-up (engines launching,
    #: bounded by their own launch timeout), not for a generation.
    setting_up: bool = False

    def tick_if_setting_up(self) -> int:
        """The figure to renew with (one more than the last while the task waits for its job's set-up)."""
        if self.setting_up:
            self.units += 1
        return self.units

    def add(self, outputs: Sequence[GenerationOutput]) -> None:
        """One generation call answered with these outputs."""
        self.units += 1 + sum(len(output.token_ids) for output in outputs)


@dataclasses.dataclass(frozen=True)
class RolloutTaskInput:
    """One leased rollout task, already decoded from the proto."""

    job_id: str
    task_id: str
    task_index: int
    seed: int
    group_size: int
    #: Counts the task's work as it goes (what its lease renewals report).
    progress: TaskProgress = dataclasses.field(default_factory=TaskProgress, compare=False)


@dataclasses.dataclass(frozen=True)
class EpisodeError:
    """Why one episode failed."""

    sample_index: int
    error_type: str
    message: str
    traceback: str
    #: The episode's reward failed (:class:`flexmarl.rewards.RewardFailed`): it alone is dropped.
    reward: bool = False


#: The longest reason a dropped episode is reported with.
MAX_FAILURE_REASON_CHARS = 500


@dataclasses.dataclass(frozen=True)
class RolloutResult:
    """Outcome of one task: the experiences of its episodes, those dropped as their reward failed, or the errors.

    ``errors``: failures that fail the whole task (it is re-issued); no experiences then.
    ``failed_episodes``: episodes whose reward failed, dropped; the others' experiences are
    ``experiences``, or none and ``given_up`` when fewer than
    :func:`flexmarl.experience.min_episodes_to_train` are left. ``returns[i][agent]`` is the
    episode return of ``agent`` in sample i (successful episodes only); ``coalesced_requests``
    counts backend calls that coalesced first turns of several episodes (an episode's own
    ``generate_n`` call is not one).
    """

    task_id: str
    experiences: tuple[ExperienceRecord, ...]
    errors: tuple[EpisodeError, ...]
    returns: Mapping[int, Mapping[str, float]]
    backend_calls: int
    coalesced_requests: int
    failed_episodes: tuple[FailedEpisode, ...] = ()
    given_up: bool = False

    @property
    def ok(self) -> bool:
        """True when the task has experiences to train on (every episode, or enough of them)."""
        return not self.errors and not self.given_up


@dataclasses.dataclass(frozen=True)
class EvaluationResult:
    """Outcome of one eval task: every episode's outcome when all succeeded, else the errors."""

    task_id: str
    episodes: tuple[EvalEpisode, ...]
    errors: tuple[EpisodeError, ...]

    @property
    def ok(self) -> bool:
        """True when every episode succeeded."""
        return not self.errors


def _greedy(request: TurnRequest) -> TurnRequest:
    """The request at temperature 0 (an evaluation's greedy sampling, whatever the episode asked)."""
    return dataclasses.replace(request, sampling={**request.sampling, "temperature": 0.0})


def _versions_of(turns: Sequence[TurnRecord], agent: str) -> tuple[int, ...]:
    """Every policy version that generated a token of ``agent``'s turns, ascending."""
    seen = {turn.behavior_version for turn in turns if turn.agent == agent}
    seen.update(version for turn in turns if turn.agent == agent for _, version in turn.version_spans)
    return tuple(sorted(seen))


def _sampling_key(sampling: Mapping[str, Any]) -> str:
    return json.dumps(sampling, sort_keys=True, default=str)


class _CountingBackend:
    def __init__(self, backend: GenerationBackend, progress: TaskProgress) -> None:
        self._backend = backend
        self._progress = progress
        self.calls = 0
        self.coalesced = 0

    async def generate(self, request: TurnRequest, n: int, affinity_key: str, *,
                       coalesced: bool = True) -> list[GenerationOutput]:
        self.calls += 1
        if n > 1 and coalesced:
            self.coalesced += 1
        outputs = await self._backend.generate(
            request.agent, list(request.input_ids), dict(request.sampling), n, affinity_key
        )
        if len(outputs) != n:
            raise DataLoss(f"backend returned {len(outputs)} samples for n={n}")
        self._progress.add(outputs)
        return list(outputs)


class FirstTurnCoalescer:
    """Batches identical first requests of a group's episodes into one n-request."""

    def __init__(
        self,
        group_size: int,
        task_id: str,
        send: Callable[[TurnRequest, int, str], Any],
    ) -> None:
        self._group_size = group_size
        self._task_id = task_id
        self._send = send
        self._pending: dict[int, tuple[TurnRequest, asyncio.Future[GenerationOutput]]] = {}
        self._withdrawn: set[int] = set()
        self._flushed = False
        self._dispatches: list[asyncio.Task[None]] = []

    async def submit(self, sample_index: int, request: TurnRequest) -> GenerationOutput:
        """The first request of episode ``sample_index``; resolves once the group flushes."""
        if self._flushed or sample_index in self._pending or sample_index in self._withdrawn:
            raise InvalidArgument(f"episode {sample_index} already passed the first-turn barrier")
        future: asyncio.Future[GenerationOutput] = asyncio.get_running_loop().create_future()
        self._pending[sample_index] = (request, future)
        self._maybe_flush()
        return await future

    def withdraw(self, sample_index: int) -> None:
        """Episode ``sample_index`` ended (or failed) without a first request."""
        if self._flushed or sample_index in self._pending:
            return
        self._withdrawn.add(sample_index)
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self._flushed or len(self._pending) + len(self._withdrawn) < self._group_size:
            return
        self._flushed = True
        groups: dict[tuple[str, tuple[int, ...], str], list[int]] = {}
        for sample_index in sorted(self._pending):
            request = self._pending[sample_index][0]
            key = (request.agent, request.input_ids, _sampling_key(request.sampling))
            groups.setdefault(key, []).append(sample_index)
        for members in groups.values():
            self._dispatches.append(asyncio.create_task(self._dispatch(members)))

    async def _dispatch(self, members: list[int]) -> None:
        request = self._pending[members[0]][0]
        affinity = (
            group_affinity_key(self._task_id) if len(members) > 1 else episode_affinity_key(self._task_id, members[0])
        )
        futures = [self._pending[i][1] for i in members]
        try:
            outputs = await self._send(request, len(members), affinity)
        except Exception as exc:  # delivered to every waiting episode
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
            return
        for future, output in zip(futures, outputs, strict=True):
            if not future.done():
                future.set_result(output)

    async def aclose(self) -> None:
        """Cancels dispatches still running (the task was cancelled or failed)."""
        for task in self._dispatches:
            task.cancel()
        await asyncio.gather(*self._dispatches, return_exceptions=True)


@dataclasses.dataclass
class _EpisodeOutcome:
    turns: list[TurnRecord]
    returns: dict[str, float]
    error: EpisodeError | None
    turn_rewards: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)
    episode_rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)


def _fails_group(error: EpisodeError | None) -> bool:
    """Whether an episode's error fails its whole group (anything but its reward failing)."""
    return error is not None and not error.reward


def turn_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """Discounted returns of an agent's turns: ``G_k = r_k + gamma * G_{k+1}`` (the last turn's is its reward)."""
    out = [0.0] * len(rewards)
    following = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        following = rewards[k] + gamma * following
        out[k] = following
    return out


class RolloutRunner:
    """Runs rollout tasks of one environment against a generation backend."""

    def __init__(
        self,
        env: Environment,
        agents: Mapping[str, AgentRuntime],
        backend: GenerationBackend,
        *,
        coalesce_first_turn: bool = True,
        fail_fast: bool = True,
        clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        """Builds a runner.

        Args:
            env: the user environment.
            agents: runtime of every agent the environment lists.
            backend: generation backend (balancer + engines in rolloutd, a fake in tests).
            coalesce_first_turn: send identical first requests of a group once with n.
            fail_fast: cancel the other episodes as soon as one fails for a reason other than its reward
                (an episode whose reward failed is dropped alone).
            clock_ms: wall clock for ``created_unix_ms`` (injectable for tests).
        """
        missing = [agent for agent in env.agents if agent not in agents]
        if missing:
            raise InvalidArgument(f"no runtime for agents {missing}")
        self._env = env
        self._shape_reward = reward_shaper(env)
        self._agents = {agent: agents[agent] for agent in env.agents}
        self._backend = backend
        self._coalesce = coalesce_first_turn
        self._fail_fast = fail_fast
        self._clock_ms = clock_ms

    async def run(self, task_input: RolloutTaskInput) -> RolloutResult:
        """Plays ``group_size`` episodes of one task; never raises for a failed episode."""
        if task_input.group_size < 1:
            raise InvalidArgument(f"group_size must be >= 1, got {task_input.group_size}")
        try:
            task = self._env.task(task_input.task_index, task_input.seed)
        except Exception as exc:
            error = EpisodeError(-1, type(exc).__name__, str(exc), traceback.format_exc())
            return RolloutResult(task_input.task_id, (), (error,), {}, 0, 0)
        backend = _CountingBackend(self._backend, task_input.progress)
        outcomes, errors = await self._play_group(task_input, task, backend)
        returns = {i: o.returns for i, o in outcomes.items() if o.error is None}
        fatal = tuple(error for error in errors if _fails_group(error))
        if fatal:
            logger.warning("task %s failed: %s", task_input.task_id, fatal[0].message)
            return RolloutResult(task_input.task_id, (), fatal, returns, backend.calls, backend.coalesced)
        dropped = tuple(FailedEpisode(error.sample_index, error.message[:MAX_FAILURE_REASON_CHARS])
                        for error in errors)
        survivors = {i: outcome for i, outcome in outcomes.items() if outcome.error is None}
        if dropped:
            logger.warning("task %s: dropping %d of %d episodes, their reward failed (episode %d: %s)",
                           task_input.task_id, len(dropped), task_input.group_size, dropped[0].sample_index,
                           dropped[0].reason)
        if len(survivors) < min_episodes_to_train(task_input.group_size):
            return RolloutResult(task_input.task_id, (), (), returns, backend.calls, backend.coalesced,
                                 failed_episodes=dropped, given_up=True)
        try:
            experiences = self._experiences(task_input, task, survivors)
        except Exception as exc:  # the environment's shape_reward is user code too
            error = EpisodeError(-1, type(exc).__name__, str(exc), traceback.format_exc())
            logger.warning("task %s failed: %s", task_input.task_id, error.message)
            return RolloutResult(task_input.task_id, (), (error,), returns, backend.calls, backend.coalesced)
        return RolloutResult(task_input.task_id, experiences, (), returns, backend.calls, backend.coalesced,
                             failed_episodes=dropped)

    async def evaluate(self, task_input: RolloutTaskInput, greedy: bool) -> EvaluationResult:
        """Plays ``group_size`` episodes of held-out task ``task_index`` (``Environment.eval_task``); no experiences.

        ``greedy``: every turn at temperature 0, whatever the episode asks. Never raises for a failed episode.
        """
        if task_input.group_size < 1:
            raise InvalidArgument(f"group_size must be >= 1, got {task_input.group_size}")
        try:
            task = self._env.eval_task(task_input.task_index, task_input.seed)
        except Exception as exc:
            return EvaluationResult(task_input.task_id, (), (
                EpisodeError(-1, type(exc).__name__, str(exc), traceback.format_exc()),))
        backend = _CountingBackend(self._backend, task_input.progress)
        outcomes, errors = await self._play_group(task_input, task, backend, greedy=greedy)
        if errors:
            logger.warning("eval task %s failed: %s", task_input.task_id, errors[0].message)
            return EvaluationResult(task_input.task_id, (), errors)
        return EvaluationResult(task_input.task_id, tuple(
            EvalEpisode(task_index=task_input.task_index, sample_index=i, returns=dict(o.returns),
                        team_success=team_success_note(o.notes),
                        versions={agent: _versions_of(o.turns, agent) for agent in self._env.agents},
                        role_correct=role_correct_note(o.notes))
            for i, o in sorted(outcomes.items())), ())

    async def _play_group(self, task_input: RolloutTaskInput, task: Any, backend: _CountingBackend,
                          greedy: bool = False) -> tuple[dict[int, _EpisodeOutcome], tuple[EpisodeError, ...]]:
        """Plays the task's ``group_size`` episodes concurrently: their outcomes and, in sample order, the errors."""
        coalescer = FirstTurnCoalescer(task_input.group_size, task_input.task_id, backend.generate)
        episodes = [
            asyncio.create_task(self._play(task_input, task, i, backend, coalescer, greedy))
            for i in range(task_input.group_size)
        ]
        try:
            pending: set[asyncio.Task[_EpisodeOutcome]] = set(episodes)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if self._fail_fast and any(_fails_group(t.result().error) for t in done):
                    break
        finally:
            for episode in episodes:
                episode.cancel()
            await asyncio.gather(*episodes, return_exceptions=True)
            await coalescer.aclose()
        outcomes = {i: t.result() for i, t in enumerate(episodes) if t.done() and not t.cancelled()}
        return outcomes, tuple(o.error for _, o in sorted(outcomes.items()) if o.error is not None)

    async def _play(
        self,
        task_input: RolloutTaskInput,
        task: Any,
        sample_index: int,
        backend: _CountingBackend,
        coalescer: FirstTurnCoalescer,
        greedy: bool = False,
    ) -> _EpisodeOutcome:
        first_request_made = False

        async def sampler(index: int, request: TurnRequest) -> GenerationOutput:
            nonlocal first_request_made
            if greedy:
                request = _greedy(request)
            if self._coalesce and not first_request_made:
                first_request_made = True
                return await coalescer.submit(index, request)
            first_request_made = True
            outputs = await backend.generate(request, 1, episode_affinity_key(task_input.task_id, index))
            return outputs[0]

        async def multi_sampler(index: int, request: TurnRequest, n: int) -> list[GenerationOutput]:
            nonlocal first_request_made
            if greedy:
                request = _greedy(request)
            if self._coalesce and not first_request_made:
                coalescer.withdraw(index)  # an n-request is never merged with other episodes' first turns
            first_request_made = True
            return await backend.generate(request, n, episode_affinity_key(task_input.task_id, index), coalesced=False)

        ctx = EpisodeContext(
            agents={name: runtime.tokenizer for name, runtime in self._agents.items()},
            sampling_defaults={name: runtime.sampling for name, runtime in self._agents.items()},
            sample_index=sample_index,
            rng=episode_rng(task_input.seed, task_input.task_index, sample_index),
            sampler=sampler,
            multi_sampler=multi_sampler,
        )
        try:
            await self._env.episode(ctx, task)
        except RewardFailed as exc:  # this episode is dropped; the group's others play on
            error = EpisodeError(sample_index, type(exc).__name__, str(exc), traceback.format_exc(), reward=True)
            return _EpisodeOutcome(ctx.turns(), ctx.returns(), error)
        except Exception as exc:  # user code must never take the daemon down
            error = EpisodeError(sample_index, type(exc).__name__, str(exc), traceback.format_exc())
            return _EpisodeOutcome(ctx.turns(), ctx.returns(), error)
        finally:
            if self._coalesce and not first_request_made:
                coalescer.withdraw(sample_index)
        return _EpisodeOutcome(ctx.turns(), ctx.returns(), None, ctx.turn_rewards(), ctx.episode_rewards(),
                               dict(ctx.notes))

    def _turn_returns(self, task: Any, sample_index: int, outcome: _EpisodeOutcome) -> dict[tuple[str, int], float]:
        """(agent, turn) -> the turn's return: its reward (shaped by the environment) plus the discounted later ones."""
        out: dict[tuple[str, int], float] = {}
        episode = EpisodeRecord(sample_index, tuple(outcome.turns), dict(outcome.returns), dict(outcome.notes))
        for agent in self._env.agents:
            turns = sorted((t for t in outcome.turns if t.agent == agent), key=lambda t: t.turn)
            if not turns:
                continue
            by_turn = outcome.turn_rewards.get(agent, {})
            rewards = []
            for i, turn in enumerate(turns):
                reward = by_turn.get(turn.turn, 0.0)
                if i == len(turns) - 1:
                    reward += outcome.episode_rewards.get(agent, 0.0)
                shaped = float(self._shape_reward(task, turn, reward, episode))
                if not math.isfinite(shaped):
                    raise InvalidArgument(f"shape_reward gave {shaped!r} for {agent!r} turn {turn.turn}")
                rewards.append(shaped)
            gamma = self._agents[agent].gamma
            for turn, value in zip(turns, turn_returns(rewards, gamma), strict=True):
                out[(agent, turn.turn)] = value
        return out

    def _experiences(
        self, task_input: RolloutTaskInput, task: Any, outcomes: Mapping[int, _EpisodeOutcome]
    ) -> tuple[ExperienceRecord, ...]:
        created_ms = self._clock_ms()
        records: list[ExperienceRecord] = []
        for sample_index in sorted(outcomes):
            outcome = outcomes[sample_index]
            returns = self._turn_returns(task, sample_index, outcome)
            for turn in sorted(outcome.turns, key=lambda t: (self._env.agents.index(t.agent), t.turn)):
                records.append(
                    ExperienceRecord(
                        experience_id=experience_id(task_input.task_id, sample_index, turn.agent, turn.turn),
                        job_id=task_input.job_id,
                        agent=turn.agent,
                        task_id=task_input.task_id,
                        group_id=group_id(task_input.task_id, turn.agent),
                        sample_index=sample_index,
                        episode_id=f"{task_input.task_id}/{sample_index}",
                        turn=turn.turn,
                        behavior_version=turn.behavior_version,
                        reward=returns[(turn.agent, turn.turn)],
                        episode_return=float(outcome.returns.get(turn.agent, 0.0)),
                        prompt_token_ids=np.asarray(turn.prompt_token_ids, dtype=np.int32),
                        response_token_ids=np.asarray(turn.response_token_ids, dtype=np.int32),
                        response_logprobs=np.asarray(turn.response_logprobs, dtype=np.float32),
                        response_version_spans=version_spans_array(turn.version_spans),
                        retokenized_messages=turn.retokenized_messages,
                        group_size=task_input.group_size,
                        created_unix_ms=created_ms,
                    )
                )
        return tuple(records)


def group_experiences_by_agent(records: Sequence[ExperienceRecord]) -> dict[str, list[ExperienceRecord]]:
    """Experiences of one task per agent (its GRPO group), in record order."""
    by_agent: dict[str, list[ExperienceRecord]] = {}
    for record in records:
        by_agent.setdefault(record.agent, []).append(record)
    return by_agent
