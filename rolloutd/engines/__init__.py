"""Inference engines of rolloutd: one package per backend, plus what they share.

One engine replica is one SGLang server (GPU hosts), one embedded engine server (CPU) or one
vLLM server. SGLang and the embedded engine speak the same subset of SGLang's native HTTP API
(docs/engines.md), so rolloutd drives both through :class:`rolloutd.engines.sglang.SGLangClient`;
vLLM has its own client. Packages: :mod:`.sglang` (the SGLang client), :mod:`.embedded` (the
embedded CPU engine and the SGLang-protocol HTTP server it and the synthetic engine serve
through), :mod:`.vllm` (vLLM's client and command line). Shared: :mod:`.protocol`
(engine-neutral types, SGLang's sampling contract), :mod:`.http_client` (the clients' HTTP
transport), :mod:`.launcher` and :mod:`.supervisor` (replica processes), :mod:`.lora` (LoRA as
SGLang serves it), :mod:`.weight_messages` (SGLang's weight-update messages).
"""
