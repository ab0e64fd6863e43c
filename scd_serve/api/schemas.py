"""Request bodies of the OpenAI-compatible routes (pydantic) and the error body.

Types are checked here, ranges and semantics by `sampling.py`; both answer 400 naming the
field. An unknown field is refused (`Unrecognized request argument supplied: <name>`, as
OpenAI answers), not dropped: its sender expects it to change the output. Fields that do not
(`user`, `store`, `metadata`, `service_tier`) are accepted and ignored; chat messages ignore
extra keys (replayed conversations carry `refusal`, ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from scd_serve.config.methods import REQUEST_METHODS

Number = StrictInt | StrictFloat
Method = Literal[REQUEST_METHODS]  # type: ignore[valid-type]  # the vocabulary: an unknown name is a 400 here


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = Field(
        False, description="extension, as in vLLM: with include_usage, each chunk carries its choice's usage so far")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(None, alias="schema",
                                                         description="the JSON schema; omitted: any JSON object")
    strict: StrictBool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | StrictStr | StrictBool | None = Field(None, alias="json", description="a JSON schema")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = Field(None, description="an EBNF grammar (xgrammar's dialect, root rule `root`)")
    json_object: StrictBool | None = None


class _Generation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = Field(None, description="default from generation_config.json, else 1")
    top_p: Number | None = None
    top_k: StrictInt | None = Field(None, description="-1 = off (extension, as in vLLM)")
    min_p: Number | None = Field(None, description="extension, as in vLLM: 0 = off")
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, description="extension, as in vLLM")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = Field(None, description="extension, as in vLLM: 1 = off")
    logit_bias: dict[StrictStr, Number] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    min_tokens: StrictInt = Field(0, description="extension, as in vLLM: no end before this many tokens")
    ignore_eos: StrictBool = Field(False, description="extension: keep generating past end-of-sequence")
    prompt_logprobs: StrictInt | None = Field(
        None, description="extension, as in vLLM: 0..20 alternatives per prompt token; the log-probabilities of "
                          "the prompt (None for its first token), computed by the consumer's own prefill; not "
                          "with stream")
    return_tokens_as_token_ids: StrictBool = Field(
        False, description="extension, as in vLLM: logprob tokens as 'token_id:<id>' instead of text")
    scd_method: Method | None = Field(
        None, description="extension: how the prompt's KV cache reaches the decode worker "
                          "('local' = no transfer, 'raw', 'scd', ..., 'auto' = the fastest the server's quality "
                          "budget allows, picked per request); default from the server config. The response "
                          "says which method served, and why, in its `scd` field and x-scd-method headers")
    # structured outputs (engine/grammar.py): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="extension, as in vLLM")
    guided_json: dict[str, Any] | StrictStr | None = Field(None, description="extension, as in vLLM: a JSON schema")
    guided_regex: StrictStr | None = Field(None, description="extension, as in vLLM")
    guided_choice: list[StrictStr] | None = Field(None, description="extension, as in vLLM")
    guided_grammar: StrictStr | None = Field(None, description="extension, as in vLLM: EBNF")
    # accepted, ignored: they do not change what is generated
    user: StrictStr | None = None
    store: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    service_tier: StrictStr | None = None


class CompletionRequest(_Generation):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = Field(None, description="not supported: only null is accepted")


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    arguments: StrictStr = Field("{}", description="JSON text, as OpenAI sends it")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant: the calls it made")
    tool_call_id: StrictStr | None = Field(None, description="tool: the call this message answers")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: StrictBool | None = Field(None, description="accepted; constrained calls always follow the schema")


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    parallel_tool_calls: StrictBool | None = Field(None, description="false: at most one call (required)")


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: either `prompt` or chat `messages` (through the chat template)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = Field(None, description="default: true for prompt, false for messages")
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[StrictInt]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None
    request_id: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES = {
    code: {"model": ErrorBody, "description": text}
    for code, text in [(400, "invalid request (schema, range, or an unsupported field)"),
                       (401, "missing or wrong API key"), (404, "unknown model"), (413, "body too large"),
                       (415, "body is not application/json"),
                       (429, "overloaded, retry after Retry-After seconds"), (500, "internal error"),
                       (502, "transfer from the prefill worker failed"), (503, "not ready or shutting down"),
                       (504, "deadline exceeded")]
}
