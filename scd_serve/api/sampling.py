"""Request body -> SamplingParams, with the range and semantic checks (400, naming the field)."""

from __future__ import annotations

from scd_serve.config.api import ApiConfig
from scd_serve.engine.request import SamplingParams
from scd_serve.errors import InvalidRequest, PromptTooLong


def sampling_params(body, config: ApiConfig, max_tokens: int | None) -> SamplingParams:
    if body.n != 1:
        raise InvalidRequest(f"n must be 1 (one completion per request), got {body.n}", field="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise InvalidRequest(f"{name} is not supported; leave it at 0", field=name)
    if max_tokens is None:
        max_tokens = min(config.default_max_tokens, config.max_tokens_cap)
    elif max_tokens > config.max_tokens_cap:
        raise InvalidRequest(f"max_tokens must be <= {config.max_tokens_cap}, got {max_tokens}", field="max_tokens")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > config.max_stop:
        raise InvalidRequest(f"stop may hold at most {config.max_stop} sequences, got {len(stop)}", field="stop")
    if any(len(s) > config.max_stop_chars for s in stop):
        raise InvalidRequest(f"each stop sequence may be at most {config.max_stop_chars} characters", field="stop")
    return SamplingParams(  # raises InvalidRequest(field=...) on out-of-range values
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        seed=body.seed,
        max_tokens=max_tokens,
        stop=tuple(stop),
        ignore_eos=body.ignore_eos,
    )


def check_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens < 1:
        raise InvalidRequest("prompt is empty: it must contain at least one token", field="prompt")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLong(
            f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: together "
            f"{num_prompt_tokens + max_tokens}, more than the maximum context length {max_model_len}; "
            f"shorten the prompt or lower max_tokens", field="max_tokens")
