"""The embedded engine: a CPU inference server speaking the RL subset of SGLang's HTTP API.

It serves a Hugging Face transformers causal LM with torch on CPU, so CI (no GPU) drives the
same client code path (:class:`rolloutd.engines.sglang.SGLangClient`) as a GPU SGLang server.
SGLang 0.5.23 is the reference, strictness included (docs/engines.md lists the subset); each
module mirrors one part of it and names the SGLang source files it follows:

* :mod:`.server`: the HTTP surface (routes, rids, abort, pause, LoRA names, weight-update
  routes, error shapes; sglang/srt/entrypoints/http_server.py, sglang/srt/managers/tokenizer_manager.py),
  with the request schemas in :mod:`.schemas` (sglang/srt/managers/io_struct.py,
  sglang/api/v1/api_types.py), the answer objects in :mod:`.outputs` and the LoRA adapters' names in
  :mod:`.adapter_names` (tokenizer_control_mixin.py). It drives any
  :class:`~.interface.EngineBackend` (:mod:`.interface`): the synthetic engine
  (``benchmarks/synthetic_engine.py``) serves through it too.
* :mod:`.backend`: the embedded engine under that server.
* :mod:`.engine`: the scheduler (continuous batching, pauses, weight swaps; sglang/srt/managers/scheduler.py),
  with :mod:`.admission` (which queued jobs join the batch; schedule_policy.py) and :mod:`.work`
  (what it queues).
* :mod:`.runner`: forward passes over the running batch's KV cache (sglang/srt/model_executor/model_runner.py);
  :mod:`.model`: loading a checkpoint.
* :mod:`.sampling`: sampling, logprobs, seeds and stop conditions (sglang/srt/layers/sampler.py,
  sglang/srt/sampling/sampling_batch_info.py, sglang/srt/managers/schedule_batch.py).
* :mod:`.adapters`: LoRA adapters (sglang/srt/lora/lora_manager.py).
* :mod:`.weight_receiver`: trainers' weight-update groups
  (sglang/srt/model_executor/model_runner_components/weight_updater.py).
* :mod:`.cli`: ``python -m rolloutd.engines.embedded`` (sglang/srt/server_args.py's flags).

Importing this package imports nothing (the synthetic engine uses :mod:`.server` without torch).
"""
