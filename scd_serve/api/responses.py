"""Response bodies, for /openapi.json: what each route answers (200), as OpenAI and vLLM shape it.

The routes build these bodies as dicts (api/sse.py, api/render.py); the models here document
them and the schema fuzz test checks every answer against them (response_schema_conformance),
so a drift between the two fails a test. A stream is `text/event-stream` of the chunk objects.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from scd_serve.api.schemas import ERROR_RESPONSES


class ModelPermission(BaseModel):
    id: str
    object: Literal["model_permission"] = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V the decode worker's prefix cache held


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    scd: dict[str, Any] | None = None  # extension: how the prompt's KV reached the decode worker


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    scd: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


class Status(BaseModel):
    status: str


class Empty(BaseModel):
    """/health's body: `{}` (its status code is the answer)."""


# one SSE event (as OpenAPI tools read a stream: an object per event): `data` is a chunk object's
# JSON, an error body's, or `[DONE]` last
STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "description": "with stream: true: SSE, one event per chunk object (`data: {...}`), then `data: [DONE]`"}}}


def ok(model: type[BaseModel], errors: tuple[int, ...] | None = None, stream: bool = False) -> dict:
    """A route's `responses`: its 200 body (and stream) and the error bodies it can answer."""
    extra = {"content": STREAM} if stream else {}
    return {200: {"model": model, **extra}} | {code: ERROR_RESPONSES[code] for code in
                                               (ERROR_RESPONSES if errors is None else errors)}
