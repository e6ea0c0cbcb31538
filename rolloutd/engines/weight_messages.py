"""SGLang 0.5.23's answers to the weight-update-group routes, shared by the engines (no torch needed).

Texts of sglang/srt/model_executor/model_runner_components/weight_updater.py and
sglang/srt/managers/scheduler_components/weight_updater.py.
"""

from __future__ import annotations

INIT_OK = "Succeeded to initialize custom process group."
DESTROY_OK = "Succeeded to destroy custom process group."
DESTROY_MISSING = "The group to be destroyed does not exist."
UPDATE_OK = "Succeeded to update parameter online."
NO_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
SESSION_MISSING = "no weight-update session is open; call begin_weight_update() first"

#: Bytes per element of the dtype names a trainer sends (``getattr(torch, name).itemsize``).
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

__all__ = [
    "DESTROY_MISSING",
    "DESTROY_OK",
    "DTYPE_BYTES",
    "INIT_OK",
    "NO_SESSION",
    "SESSION_MISSING",
    "SESSION_OPEN",
    "UPDATE_OK",
]
