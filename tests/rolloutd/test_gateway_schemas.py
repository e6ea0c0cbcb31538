"""The gateway's request models against the official ``openai`` package's request types, and their errors.

The answers over HTTP are tested in test_gateway.py (``MALFORMED``); these run without a network.
"""

from __future__ import annotations

import typing
from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from rolloutd.gateway.schemas import ChatCompletionRequest, CompletionRequest, OpenAIError, parse_request

USER = {"role": "user", "content": "x"}
# Accepted and ignored on both routes although the official API defines them for chat completions only.
CHAT_ONLY_IGNORED = {"safety_identifier", "parallel_tool_calls", "prompt_cache_key", "store", "metadata",
                     "reasoning_effort", "service_tier", "verbosity", "modalities"}


def test_every_field_the_gateway_accepts_is_one_of_the_official_apis() -> None:
    chat = set(typing.get_type_hints(chat_create_params.CompletionCreateParamsStreaming))
    completion = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsStreaming))
    assert set(ChatCompletionRequest.model_fields) <= chat
    assert set(CompletionRequest.model_fields) <= completion | CHAT_ONLY_IGNORED


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"temperature": None, "user": None, "n": None}, None, None),  # null is an absent field
        ({"zeta": 1, "alpha": 2, "temperature": "hot"}, "alpha", None),  # an unknown field is reported first
        # the range code names the field's type (a decimal), not the value's (an integer)
        ({"frequency_penalty": -3}, "frequency_penalty", "decimal_below_min_value"),
        ({"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
        ({"stop": ["a", 3]}, "stop[1]", "invalid_type"),
        ({"stream": True, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage", "invalid_type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
         "tools[0].function.parameters", "invalid_type"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content", None),  # only text parts, whatever else the part lacks
    ],
)
def test_a_body_that_fails_a_model_is_the_official_apis_400(fields: dict[str, Any], param: str | None,
                                                             code: str | None) -> None:
    body = {"model": "a", "messages": [USER], **fields}
    if param is None:
        assert parse_request(ChatCompletionRequest, body).n == 1
        return
    with pytest.raises(OpenAIError) as error:
        parse_request(ChatCompletionRequest, body)
    assert (error.value.status, error.value.param, error.value.code) == (400, param, code)
    assert error.value.type == "invalid_request_error" and error.value.message


def test_sampling_overrides_keep_their_bounds() -> None:
    call = parse_request(ChatCompletionRequest, {"model": "a", "messages": [USER], "temperature": 1,
                                                 "max_completion_tokens": 50, "max_tokens": 2, "stop": "x"})
    assert call.sampling({"max_new_tokens": 8}) == {"temperature": 1.0, "max_new_tokens": 8, "stop": ["x"]}
    completion = parse_request(CompletionRequest, {"model": "a", "prompt": ["p"], "max_tokens": 3})
    assert completion.text == "p" and completion.sampling({}) == {"max_new_tokens": 3}
