"""The experience shapes shared by rolloutd, stored, traind, orchestratord and the SDK.

Three shapes, each carrying different data, with one conversion between each pair that meets:

- :class:`ExperienceRecord`: the whole experience (token ids, logprobs, rewards), written to and read
  from stored. Token ids and logprobs are numpy arrays in memory and packed little-endian bytes on
  the wire (int32 ids, float32 logprobs), as are the per-token versions (int32 ``(start, version)``
  spans, :func:`version_spans_array`).
- :class:`flexmarl.store_client.ExperienceRef`: stored's query result (ids, group metadata and
  lifecycle state, no arrays).
- :class:`ExperienceSummary`: what orchestratord plans with (ids, group, version, length, reward),
  reported by rolloutd. Built from a record (:meth:`ExperienceSummary.of_record`, a fresh rollout)
  or from a ref (:meth:`ExperienceSummary.of_ref`, what an earlier attempt already stored); the
  daemons' serde modules are the only places it meets its proto.

Each shape carries two rewards under their own names: ``reward``, the return the turn is trained
with (shaped by :meth:`flexmarl.episode.Environment.shape_reward`, discounted by ``gamma``), and
``episode_return``, the agent's unshaped episode return, what is reported (``None`` on an
experience written before the field existed: :func:`reported_return` falls back to ``reward``).
"""

from __future__ import annotations

import dataclasses
import enum
import typing

import numpy as np
import numpy.typing as npt

from flexmarl.errors import InvalidArgument
from flexmarl.ids import ExperienceKey, GroupRef
from flexmarl.v1 import common_pb2

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
SPAN_DTYPE = np.dtype("<i4")


class ExperienceState(enum.IntEnum):
    """Lifecycle of an experience in stored (values equal the proto enum)."""

    READY = common_pb2.EXPERIENCE_STATE_READY
    LEASED = common_pb2.EXPERIENCE_STATE_LEASED
    CONSUMED = common_pb2.EXPERIENCE_STATE_CONSUMED


@dataclasses.dataclass(frozen=True)
class FailedEpisode:
    """An episode dropped from its task because its reward failed (raised, timed out, gave no finite number).

    Reported by rolloutd beside the task's other episodes' experiences; orchestratord counts it and
    trains the rest of the group (:func:`min_episodes_to_train`). Nothing of it is stored.
    """

    sample_index: int
    #: Why, for people (``reward 'm:f' timed out after 10 s``).
    reason: str


def min_episodes_to_train(group_size: int) -> int:
    """The fewest surviving episodes a task's groups train with: 2 (a group of one has no baseline), or 1 of 1.

    A task left with fewer (its other episodes' rewards failed) is given up: it trains nothing and is
    not re-issued (docs/workflows.md, "When a reward fails").
    """
    return min(2, group_size)


def experience_id(task_id: str, sample_index: int, agent: str, turn: int) -> str:
    """The deterministic id of one (episode, agent turn) (see :class:`flexmarl.ids.ExperienceKey`)."""
    return str(ExperienceKey(task_id, sample_index, agent, turn))


def group_id(task_id: str, agent: str) -> str:
    """The GRPO group of an agent's experiences within one task (see :class:`flexmarl.ids.GroupRef`)."""
    return str(GroupRef(task_id, agent))


@typing.runtime_checkable
class _StoredRef(typing.Protocol):
    """The fields of :class:`flexmarl.store_client.ExperienceRef` a summary needs (no import cycle)."""

    @property
    def experience_id(self) -> str: ...  # noqa: D102
    @property
    def group_id(self) -> str: ...  # noqa: D102
    @property
    def sample_index(self) -> int: ...  # noqa: D102
    @property
    def behavior_version(self) -> int: ...  # noqa: D102
    @property
    def response_tokens(self) -> int: ...  # noqa: D102
    @property
    def reward(self) -> float: ...  # noqa: D102
    @property
    def episode_return(self) -> float | None: ...  # noqa: D102


def reported_return(reward: float, episode_return: float | None) -> float:
    """The episode return to report of an experience: ``episode_return``, or ``reward`` where it was not recorded."""
    return reward if episode_return is None else episode_return


@dataclasses.dataclass(frozen=True)
class ExperienceSummary:
    """One experience as orchestratord plans with it (arrays stay in stored)."""

    experience_id: str
    agent: str
    group_id: str
    sample_index: int
    behavior_version: int
    response_tokens: int
    #: The trained return of the turn (shaped, discounted).
    reward: float = 0.0
    #: The agent's unshaped episode return (None: not recorded, see :func:`reported_return`).
    episode_return: float | None = None

    @property
    def task_id(self) -> str:
        """The task of the experience, derived from its group id ("<task_id>/<agent>")."""
        return GroupRef.parse(self.group_id).task_id

    @classmethod
    def of_record(cls, record: ExperienceRecord) -> ExperienceSummary:
        """The summary of a whole record (what rolloutd reports after a rollout)."""
        return cls(record.experience_id, record.agent, record.group_id, record.sample_index,
                   record.behavior_version, record.response_tokens, record.reward, record.episode_return)

    @classmethod
    def of_ref(cls, ref: _StoredRef, agent: str) -> ExperienceSummary:
        """The summary of one of stored's query results for ``agent`` (what is already durable)."""
        return cls(ref.experience_id, agent, ref.group_id, ref.sample_index, ref.behavior_version,
                   ref.response_tokens, ref.reward, ref.episode_return)


@dataclasses.dataclass(frozen=True)
class ExperienceRecord:
    """One (episode, agent turn) with its tokens, logprobs and reward."""

    experience_id: str
    job_id: str
    agent: str
    task_id: str
    group_id: str
    sample_index: int
    episode_id: str
    turn: int
    behavior_version: int
    reward: float
    prompt_token_ids: npt.NDArray[np.int32]
    response_token_ids: npt.NDArray[np.int32]
    response_logprobs: npt.NDArray[np.float32]
    group_size: int
    state: ExperienceState = ExperienceState.READY
    step_id: str = ""
    created_unix_ms: int = 0
    #: ``[S, 2]`` int32 ``(start, version)`` spans of the response tokens, ascending in start, the first at
    #: 0 (:func:`version_spans_array`); empty: every token has ``behavior_version``, the oldest token's.
    response_version_spans: npt.NDArray[np.int32] = dataclasses.field(default_factory=lambda: _NO_SPANS)
    #: Assistant messages of the prompt re-tokenized from their text because they matched no earlier turn's
    #: recorded tokens (OpenAI gateway chat calls, docs/gateway.md); 0: the prompt holds what was sampled.
    retokenized_messages: int = 0
    #: The agent's unshaped episode return, the same on each of its turns of the episode (``reward`` is
    #: the turn's trained return); None: written before the field existed (:func:`reported_return`).
    episode_return: float | None = None

    @property
    def response_tokens(self) -> int:
        """Number of generated tokens."""
        return int(self.response_token_ids.shape[0])

    def token_versions(self) -> npt.NDArray[np.int64]:
        """The policy version each response token was sampled with (``[response_tokens]``)."""
        versions = np.full(self.response_tokens, self.behavior_version, dtype=np.int64)
        for start, version in self.response_version_spans.tolist():
            versions[start:] = version
        return versions

    def to_proto(self) -> common_pb2.Experience:
        """Encodes the record, packing the arrays."""
        return common_pb2.Experience(
            experience_id=self.experience_id,
            job_id=self.job_id,
            agent=self.agent,
            task_id=self.task_id,
            group_id=self.group_id,
            sample_index=self.sample_index,
            episode_id=self.episode_id,
            turn=self.turn,
            behavior_version=self.behavior_version,
            reward=self.reward,
            prompt_token_ids=np.ascontiguousarray(self.prompt_token_ids, dtype=TOKEN_DTYPE).tobytes(),
            response_token_ids=np.ascontiguousarray(self.response_token_ids, dtype=TOKEN_DTYPE).tobytes(),
            response_logprobs=np.ascontiguousarray(self.response_logprobs, dtype=LOGPROB_DTYPE).tobytes(),
            state=typing.cast(common_pb2.ExperienceState.ValueType, int(self.state)),
            step_id=self.step_id,
            created_unix_ms=self.created_unix_ms,
            group_size=self.group_size,
            response_version_spans=np.ascontiguousarray(self.response_version_spans, dtype=SPAN_DTYPE).tobytes(),
            retokenized_messages=self.retokenized_messages,
            episode_return=self.episode_return,
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.Experience) -> ExperienceRecord:
        """Decodes and validates a wire record; raises InvalidArgument on bad arrays."""
        prompt = unpack(msg.prompt_token_ids, TOKEN_DTYPE, "prompt_token_ids")
        response = unpack(msg.response_token_ids, TOKEN_DTYPE, "response_token_ids")
        logprobs = unpack(msg.response_logprobs, LOGPROB_DTYPE, "response_logprobs")
        if logprobs.shape[0] != response.shape[0]:
            raise InvalidArgument(
                f"experience {msg.experience_id!r}: {logprobs.shape[0]} logprobs for "
                f"{response.shape[0]} response tokens"
            )
        spans = check_version_spans(
            unpack(msg.response_version_spans, SPAN_DTYPE, "response_version_spans"), msg.behavior_version,
            int(response.shape[0]), f"experience {msg.experience_id!r}",
        )
        state = ExperienceState(msg.state) if msg.state else ExperienceState.READY
        return cls(
            experience_id=msg.experience_id,
            job_id=msg.job_id,
            agent=msg.agent,
            task_id=msg.task_id,
            group_id=msg.group_id,
            sample_index=msg.sample_index,
            episode_id=msg.episode_id,
            turn=msg.turn,
            behavior_version=msg.behavior_version,
            reward=msg.reward,
            prompt_token_ids=prompt,  # type: ignore[arg-type]
            response_token_ids=response,  # type: ignore[arg-type]
            response_logprobs=logprobs,  # type: ignore[arg-type]
            group_size=msg.group_size,
            state=state,
            step_id=msg.step_id,
            created_unix_ms=msg.created_unix_ms,
            response_version_spans=spans,
            retokenized_messages=msg.retokenized_messages,
            episode_return=msg.episode_return if msg.HasField("episode_return") else None,
        )


_NO_SPANS: npt.NDArray[np.int32] = np.zeros((0, 2), dtype=SPAN_DTYPE)
_NO_SPANS.setflags(write=False)


def version_spans_array(spans: typing.Sequence[tuple[int, int]]) -> npt.NDArray[np.int32]:
    """``(start, version)`` spans as the ``[S, 2]`` int32 array of :attr:`ExperienceRecord.response_version_spans`."""
    if not spans:
        return _NO_SPANS
    return np.asarray(spans, dtype=SPAN_DTYPE).reshape(-1, 2)


def check_version_spans(
    packed: npt.NDArray[np.generic], behavior_version: int, response_tokens: int, where: str
) -> npt.NDArray[np.int32]:
    """Flat ``start, version, ...`` int32 values as spans; raises InvalidArgument unless they are well formed.

    Well formed: none, or pairs whose starts ascend strictly from 0 within the response, whose
    versions never decrease, and whose first version is ``behavior_version`` (the oldest token's).
    """
    if packed.shape[0] % 2:
        raise InvalidArgument(f"{where}: response_version_spans holds {packed.shape[0]} values, not pairs")
    spans = packed.reshape(-1, 2)
    if not spans.shape[0]:
        return _NO_SPANS
    starts, versions = spans[:, 0].tolist(), spans[:, 1].tolist()
    if (starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:], strict=False))
            or starts[-1] >= max(response_tokens, 1)
            or any(b < a for a, b in zip(versions, versions[1:], strict=False)) or versions[0] != behavior_version):
        raise InvalidArgument(f"{where}: malformed response_version_spans {spans.tolist()} for {response_tokens} "
                              f"tokens of behavior_version {behavior_version}")
    return typing.cast(npt.NDArray[np.int32], spans)


def unpack(data: bytes, dtype: np.dtype[np.generic], what: str) -> npt.NDArray[np.generic]:
    """Decodes a packed little-endian array; raises InvalidArgument on a ragged length."""
    if len(data) % dtype.itemsize:
        raise InvalidArgument(f"{what}: {len(data)} bytes is not a multiple of {dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype)
