"""vLLM's /tokenize and /detokenize: the server's own tokenizer, for clients that count tokens
or build prompts from ids without loading it. /tokenize takes a `prompt` or chat `messages`
(through the chat route's template) and answers `{"count", "max_model_len", "tokens",
"token_strs"}`; /detokenize answers `{"prompt"}`.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from scd_serve.api.prompt import chat_prompt_ids, encode
from scd_serve.api.routes import served_name
from scd_serve.api.responses import DetokenizeResponse, TokenizeResponse, ok
from scd_serve.api.schemas import DetokenizeRequest, TokenizeRequest
from scd_serve.errors import InvalidRequest

router = APIRouter()


@router.post("/tokenize", response_model=None, responses=ok(TokenizeResponse))
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state = request.app.state
    served_name(state, body.model)
    tokenizer = state.backend.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("send exactly one of prompt or messages", field="prompt")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await asyncio.to_thread(encode, tokenizer, body.prompt, add_special_tokens=special, field="prompt")
    else:
        ids = await asyncio.to_thread(chat_prompt_ids, body.messages, tokenizer, body.add_generation_prompt,
                                      bool(body.add_special_tokens))
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.config.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize", response_model=None, responses=ok(DetokenizeResponse))
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = request.app.state
    served_name(state, body.model)
    vocab = getattr(state.backend, "vocab_size", None) or len(state.backend.tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"tokens: token id {bad} outside 0..{vocab - 1}", field="tokens")
    return {"prompt": await asyncio.to_thread(state.backend.tokenizer.decode, body.tokens)}
