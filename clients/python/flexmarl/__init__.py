"""FlexMARL: shared package (protos, runtime, registry, SDK and CLI).

The episode API users write environments against is importable from here
(``from flexmarl import Environment, EpisodeContext, Task``); it lives in
:mod:`flexmarl.episode` and is imported on first use, so ``import flexmarl`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flexmarl.episode import (
        AgentTokenizer,
        ChatMessage,
        Environment,
        EpisodeContext,
        EpisodeRecord,
        Generation,
        PromptInput,
        Task,
        TopLogprobs,
        TurnRecord,
        episode_rng,
        held_out_seed,
        load_environment,
        task_rng,
    )

__version__ = "0.1.0"

__all__ = [
    "AgentTokenizer",
    "ChatMessage",
    "Environment",
    "EpisodeContext",
    "EpisodeRecord",
    "Generation",
    "PromptInput",
    "Task",
    "TopLogprobs",
    "TurnRecord",
    "episode_rng",
    "held_out_seed",
    "load_environment",
    "task_rng",
]

_EPISODE_API = frozenset(__all__)


def __getattr__(name: str) -> Any:
    """The episode API's names, imported from :mod:`flexmarl.episode` when first asked for."""
    if name in _EPISODE_API:
        return getattr(importlib.import_module("flexmarl.episode"), name)
    raise AttributeError(f"module 'flexmarl' has no attribute {name!r}")
