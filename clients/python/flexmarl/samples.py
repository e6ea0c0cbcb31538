"""What the agents said: decoded episodes of a committed step (``flexmarl samples``, the trackers' sample dumps).

stored keeps the token ids of every experience (one agent's turn of one episode); a sample is one
of them decoded with the agent's tokenizer (the one of its spec model, which every version of the
agent shares): the prompt with its special tokens (the chat template's turn markers show where each
turn starts) and the response without them (the text the environment read), with the episode's
reward. Decoding needs the model directory on this host (true of a local cluster, and of
orchestratord's host for the trackers' dumps when it shares the workers' model paths).
"""

from __future__ import annotations

import dataclasses
import threading
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from flexmarl.errors import FailedPrecondition
from flexmarl.experience import ExperienceRecord


@dataclasses.dataclass(frozen=True)
class Sample:
    """One agent turn of one episode of a committed step, as text."""

    agent: str
    step: int
    task_id: str
    sample_index: int
    turn: int
    reward: float
    behavior_version: int
    prompt: str
    response: str
    prompt_tokens: int
    response_tokens: int
    #: The token ids themselves: byte-level ids that decode to '' or U+FFFD hide what was said.
    prompt_token_ids: tuple[int, ...] = ()
    response_token_ids: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return dataclasses.asdict(self)


class TextDecoder(Protocol):
    """The part of a Hugging Face tokenizer a sample needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str:
        """Text of token ids."""
        ...


class TokenizerCache:
    """Tokenizers by model directory, each loaded once and offline; thread-safe.

    A model directory with a ``tokenizer.json`` (every fast tokenizer, the tiny models' included)
    is decoded by the ``tokenizers`` library that backs transformers' fast tokenizers, without
    importing transformers (seconds and hundreds of MB in a daemon); any other goes through
    ``AutoTokenizer`` (``local_files_only``).
    """

    def __init__(self) -> None:
        self._tokenizers: dict[str, TextDecoder] = {}
        self._lock = threading.Lock()

    def get(self, model: str) -> TextDecoder:
        """The tokenizer of a model directory; raises FailedPrecondition when it does not load here."""
        with self._lock:
            cached = self._tokenizers.get(model)
            if cached is not None:
                return cached
            try:
                loaded = _load_tokenizer(model)
            except Exception as exc:  # the tokenizers library raises plain Exception
                raise FailedPrecondition(f"cannot load the tokenizer of {model!r} on this host: "
                                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
            self._tokenizers[model] = loaded
            return loaded


def _load_tokenizer(model: str) -> TextDecoder:
    fast = Path(model) / "tokenizer.json"
    if fast.is_file():
        from tokenizers import Tokenizer

        return typing.cast(TextDecoder, Tokenizer.from_file(str(fast)))
    from transformers import AutoTokenizer  # heavy import, only for tokenizers without a tokenizer.json

    loaded: Any = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return typing.cast(TextDecoder, loaded)


def pick(experience_ids: Sequence[str], count: int) -> list[str]:
    """The ``count`` experiences of a step that are dumped: the first ids in sorted order (deterministic)."""
    return sorted(experience_ids)[:count] if count > 0 else []


def decode_samples(records: Sequence[ExperienceRecord], step: int, tokenizer: TextDecoder) -> list[Sample]:
    """The records as text, ordered by task, episode and turn."""
    ordered = sorted(records, key=lambda r: (r.task_id, r.sample_index, r.turn))
    return [
        Sample(
            agent=r.agent, step=step, task_id=r.task_id, sample_index=r.sample_index, turn=r.turn,
            reward=float(r.reward), behavior_version=r.behavior_version,
            prompt=tokenizer.decode([int(t) for t in r.prompt_token_ids], skip_special_tokens=False),
            response=tokenizer.decode([int(t) for t in r.response_token_ids], skip_special_tokens=True),
            prompt_tokens=int(r.prompt_token_ids.shape[0]), response_tokens=r.response_tokens,
            prompt_token_ids=tuple(int(t) for t in r.prompt_token_ids),
            response_token_ids=tuple(int(t) for t in r.response_token_ids),
        )
        for r in ordered
    ]


class _StepReader(Protocol):
    """The part of :class:`flexmarl.store_client.StoreClient` reading a step's experiences."""

    async def query(self, job_id: str, agent: str, *, step_id: str = ...) -> Sequence[Any]:
        """Refs of the experiences a step consumed."""
        ...

    async def read(self, job_id: str, ids: Sequence[str]) -> list[ExperienceRecord]:
        """Whole experiences."""
        ...


async def read_step_samples(store: _StepReader, job_id: str, agent: str, step: int, count: int,
                            tokenizer: TextDecoder) -> list[Sample]:
    """The first ``count`` (:func:`pick`) experiences a committed step trained on, decoded.

    stored tags a step's experiences with the step when orchestratord marks them consumed, just
    after the commit; a step whose experiences stored has since collected as garbage has none.
    """
    from flexmarl.ids import StepRef

    refs = await store.query(job_id, agent, step_id=str(StepRef(job_id, agent, step)))
    ids = pick([ref.experience_id for ref in refs], count)
    return decode_samples(await store.read(job_id, ids), step, tokenizer) if ids else []
