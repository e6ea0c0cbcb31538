"""A reward worker process: ``python -m flexmarl.reward_worker [REWARD ...]`` (started by :class:`RewardRunner`).

It imports the rewards named on its command line (so that no timed call pays for an import),
writes one ready line, then answers one JSON request per stdin line,
``{"reward": name, "response": str, "reference": ...}``, with one JSON line,
``{"value": float}`` or ``{"error": "reason"}``. It exits at end of input (its parent closed
the pipe or died). The protocol has its own copy of stdout: what reward code prints goes to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from flexmarl.entrypoints import load_entrypoint
from flexmarl.rewards import BUILTIN_REWARDS, RewardFailed, score_by_name

#: The longest error text a reply carries (the runner reads replies as lines of at most 64 KiB).
MAX_ERROR_CHARS = 2000


def _answer(request: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"value": score_by_name(str(request["reward"]), str(request["response"]), request.get("reference"))}
    except RewardFailed as exc:
        return {"error": str(exc)[:MAX_ERROR_CHARS]}
    except Exception as exc:  # loading a user module at call time, a malformed request
        return {"error": f"reward {request.get('reward')!r}: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]}


def main(argv: list[str]) -> int:
    """Serves requests until end of input."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # math-verify warns that its own timeouts are off: the runner's time limit bounds every call instead.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for name in argv:
        if name == "math_equiv":
            import math_verify  # noqa: F401 - imported now, not within a timed call
        elif name not in BUILTIN_REWARDS:
            load_entrypoint(name, "reward function")
    protocol.write("{}\n")
    for line in sys.stdin:
        protocol.write(json.dumps(_answer(json.loads(line))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
