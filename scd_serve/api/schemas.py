"""Request bodies of the OpenAI-compatible routes (pydantic) and the error body.

Types are checked here (wrong type or missing field -> 422); ranges and semantics are
checked by `sampling.py` (-> 400), so a message always names the field to fix. Unknown
fields are ignored, as OpenAI clients send extras; fields we cannot honour (n > 1,
logprobs, echo, penalties) are accepted only at their neutral values.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Generation(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = Field(None, description="-1 = off (extension, as in vLLM)")
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    ignore_eos: StrictBool = Field(False, description="extension: keep generating past end-of-sequence")
    scd_method: StrictStr | None = Field(
        None, description="extension: how the prompt's KV cache reaches the decode worker "
                          "('local' = no transfer, 'raw', 'scd', ...); default from the server config")
    user: StrictStr | None = None


class CompletionRequest(_Generation):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    echo: StrictBool = False
    logprobs: StrictInt | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None


class ErrorDetail(BaseModel):
    type: str
    message: str
    request_id: str | None = None
    param: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES = {
    code: {"model": ErrorBody, "description": text}
    for code, text in [(400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown model"),
                       (413, "body too large"),
                       (415, "body is not application/json"), (422, "body does not match the schema"),
                       (429, "overloaded, retry after Retry-After seconds"), (500, "internal error"),
                       (502, "transfer from the prefill worker failed"), (503, "not ready or shutting down"),
                       (504, "deadline exceeded")]
}
