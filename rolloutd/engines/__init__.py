"""Inference engines of rolloutd: the SGLang HTTP client, the embedded CPU engine, the launcher.

One engine replica is one SGLang server (GPU hosts) or one embedded engine server (CPU); both
speak the same subset of SGLang's native HTTP API (docs/engines.md), so rolloutd drives both
through :class:`rolloutd.engines.sglang_client.SGLangClient`.
"""
