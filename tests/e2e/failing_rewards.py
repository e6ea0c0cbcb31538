"""A user's reward function that fails on purpose, by the task row's reference (imported by rolloutd's reward workers).

``raise``: every call raises. ``hang``: every call outlives any time limit. ``once:<path>``: the
first call to create the file at ``<path>`` raises, every other call scores (so exactly one
episode of the task fails). Anything else: 1.0 when the response holds it, else 0.0.
"""

from __future__ import annotations

import os
import time
from typing import Any


def by_row(response: str, reference: Any) -> float:
    """See the module docstring."""
    text = str(reference)
    if text == "raise":
        raise RuntimeError("this row's reference cannot be read")
    if text == "hang":
        time.sleep(600)
    if text.startswith("once:"):
        try:
            os.close(os.open(text.removeprefix("once:"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return 0.0
        raise RuntimeError("the first call of this row fails")
    return 1.0 if text in response else 0.0
