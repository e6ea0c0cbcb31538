"""rolloutd's SGLang backend: the client for SGLang's native HTTP API (the RL subset).

One replica is an SGLang server (GPU hosts, ``python -m sglang.launch_server``; its command
line is :func:`rolloutd.engines.launcher.sglang_command`) or an embedded engine
(:mod:`rolloutd.engines.embedded`, which speaks the same API); rolloutd drives both through
:class:`SGLangClient`.
"""

from rolloutd.engines.sglang.client import SGLangClient, sglang_error_message

__all__ = ["SGLangClient", "sglang_error_message"]
