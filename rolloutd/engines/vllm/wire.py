"""vLLM 0.32's token-in/token-out wire schema, declared once (the subset rolloutd sends and reads).

Field names and meanings follow ``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``
(``GenerateRequest``, ``GenerateTokensChoice``, ``GenerateLogProbsContent``,
``GenerateResponseBase``), ``vllm/sampling_params.py`` (``SamplingParams``) and
``vllm/outputs.py`` (``WeightVersionSpan``). Responses ignore fields this client does not read,
so a newer server's additions do not break it; requests are built from these models only.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class VLLMSamplingParams(BaseModel):
    """``sampling_params`` of ``/inference/v1/generate`` (vLLM names, not SGLang's).

    ``top_k`` 0 disables top-k in vLLM (SGLang says -1); ``max_tokens`` is SGLang's
    ``max_new_tokens``; ``logprobs`` is the number of top alternatives (0: the sampled token's
    logprob only; None: no logprobs).
    """

    model_config = ConfigDict(extra="forbid")

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int
    logprobs: int | None = None


class VLLMGenerateRequest(BaseModel):
    """Body of ``POST /inference/v1/generate`` (``GenerateRequest``); ``model`` names a LoRA adapter."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    token_ids: list[int]
    sampling_params: VLLMSamplingParams
    model: str | None = None
    output_mode: str = "tokens"
    stream: bool = False


class VLLMLogProb(BaseModel):
    """One candidate token at one position (``GenerateLogProb``)."""

    model_config = ConfigDict(extra="ignore")

    token_id: int
    logprob: float
    rank: int | None = None


class VLLMLogProbsContent(VLLMLogProb):
    """The sampled token at one position and its candidates, the sampled one first."""

    top_logprobs: list[VLLMLogProb] = Field(default_factory=list)


class VLLMLogProbs(BaseModel):
    """Per-token logprobs of one choice (``content`` None when none were asked)."""

    model_config = ConfigDict(extra="ignore")

    content: list[VLLMLogProbsContent] | None = None


class VLLMWeightVersionSpan(BaseModel):
    """Output tokens ``[start, end)`` were sampled by weights labelled ``version`` (vllm/outputs.py)."""

    model_config = ConfigDict(extra="ignore")

    version: str
    start: int
    end: int


class VLLMChoice(BaseModel):
    """One sample (``GenerateTokensChoice`` / ``GenerateTextChoice``).

    ``finish_reason`` is ``stop`` (EOS, a stop token or a stop string), ``length`` or ``abort``;
    ``stop_reason`` is the stop token id or stop string that ended it (None on EOS).
    """

    model_config = ConfigDict(extra="ignore")

    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    text: str = ""
    weight_versions: list[VLLMWeightVersionSpan] | None = None
    logprobs: VLLMLogProbs | None = None


class VLLMUsage(BaseModel):
    """Token counts of the whole request (all samples)."""

    model_config = ConfigDict(extra="ignore")

    prompt_tokens: int = 0
    completion_tokens: int | None = 0


class VLLMGenerateResponse(BaseModel):
    """Answer of ``/inference/v1/generate`` without streaming (``GenerateResponseBase`` + choices)."""

    model_config = ConfigDict(extra="ignore")

    request_id: str
    choices: list[VLLMChoice]
    usage: VLLMUsage | None = None


class VLLMNcclInitInfo(BaseModel):
    """``init_info`` of ``POST /init_weight_transfer_engine`` for the NCCL backend (the worker's side).

    ``vllm/distributed/weight_transfer/nccl_common.py`` ``NCCLWeightTransferInitInfo``: the trainer
    is rank 0 of the group at ``master_address:master_port`` (a TCPStore rendezvous), the
    replica's workers ranks ``rank_offset`` onwards; ``packed`` must agree with the trainer's.
    """

    model_config = ConfigDict(extra="forbid")

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False


class VLLMNcclUpdateInfo(BaseModel):
    """``update_info`` of ``POST /update_weights``: the tensors of one broadcast round, in order.

    ``nccl_engine.py`` ``NCCLWeightTransferUpdateInfo`` (the three lists of one length).
    """

    model_config = ConfigDict(extra="forbid")

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
