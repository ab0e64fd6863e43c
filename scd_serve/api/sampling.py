"""Request body -> SamplingParams and a Plan (how many choices, echo), with the range and
semantic checks (400, naming the field).

An omitted field takes the model's default from generation_config.json, else OpenAI's.
Fields with no honest implementation are refused unless neutral: `suffix`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scd_serve.config.api import ApiConfig
from scd_serve.engine.request import MAX_LOGPROBS, SamplingParams
from scd_serve.errors import InvalidRequest, PromptTooLong

MAX_CHOICES = 64  # engine requests one HTTP request may start (prompts x best_of); more is 400


@dataclass(frozen=True)
class Plan:
    """What the route does around the engine requests: `best_of` run per prompt, the `n` best
    returned; `echo` puts the prompt in front; `generate` False: max_tokens 0 (the prompt's
    log-probabilities only: one token is generated and dropped, as vLLM does)."""

    n: int = 1
    best_of: int = 1
    echo: bool = False
    generate: bool = True
    logprobs: int | None = None  # what the client asked for (the engine may compute more, for best_of)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs as asked (the engine's may be more, for echo)


def sampling_params(body, config: ApiConfig, max_tokens: int | None, *, chat: bool,
                    defaults: dict[str, Any] | None = None) -> tuple[SamplingParams, Plan]:
    refuse_unsupported(body, chat)
    n, best_of = body.n, getattr(body, "best_of", None)
    best_of = n if best_of is None else best_of
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}], got {n}", field="n")
    if not n <= best_of <= MAX_CHOICES:
        raise InvalidRequest(f"best_of must be in [n={n}, {MAX_CHOICES}], got {best_of}", field="best_of")
    if body.stream and best_of != n:
        raise InvalidRequest("best_of must equal n when streaming (the best are known only at the end)",
                             field="best_of")
    echo, logprobs, generate = bool(getattr(body, "echo", False)), _logprobs(body, chat), True
    if max_tokens is None:
        max_tokens = min(config.default_max_tokens, config.max_tokens_cap)
    elif max_tokens == 0 and echo:  # a log-likelihood request: the prompt's log-probabilities only
        max_tokens, generate = 1, False
    elif max_tokens > config.max_tokens_cap:
        raise InvalidRequest(f"max_tokens must be <= {config.max_tokens_cap}, got {max_tokens}", field="max_tokens")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > config.max_stop:
        raise InvalidRequest(f"stop may hold at most {config.max_stop} sequences, got {len(stop)}", field="stop")
    if any(len(s) > config.max_stop_chars for s in stop):
        raise InvalidRequest(f"each stop sequence may be at most {config.max_stop_chars} characters", field="stop")
    d = defaults or {}

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(body, name)
        return value if value is not None else d.get(name, fallback)

    engine_logprobs = logprobs if best_of == n else max(logprobs or 0, 0)  # best_of ranks by logprob
    prompt_k = _prompt_logprobs(body, echo, logprobs)
    params = SamplingParams(  # raises InvalidRequest(field=...) on out-of-range values
        temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", -1),
        min_p=pick("min_p", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=_logit_bias(body.logit_bias), min_tokens=body.min_tokens,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        seed=body.seed, max_tokens=max_tokens, stop=tuple(stop), ignore_eos=body.ignore_eos,
        logprobs=engine_logprobs, prompt_logprobs=prompt_k,
    )
    return params, Plan(n=n, best_of=best_of, echo=echo, generate=generate, logprobs=logprobs,
                        prompt_logprobs=body.prompt_logprobs)


def _prompt_logprobs(body, echo: bool, logprobs: int | None) -> int | None:
    """The alternatives per prompt token the engine must compute: for vLLM's prompt_logprobs, and
    for echo with logprobs (the prompt's log-probabilities in front of the text); None: neither."""
    k = body.prompt_logprobs
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {k}", field="prompt_logprobs")
    if k is not None and body.stream:  # vLLM's rule: they come whole, with the first token
        raise InvalidRequest("prompt_logprobs are not available when stream=True", field="prompt_logprobs")
    wanted = [x for x in (k, logprobs if echo else None) if x is not None]
    return max(wanted) if wanted else None


def refuse_unsupported(body, chat: bool) -> None:
    if getattr(body, "suffix", None) is not None:
        raise InvalidRequest("suffix is not supported (no fill-in-the-middle)", field="suffix")


def _logprobs(body, chat: bool) -> int | None:
    """-> the number of alternatives per token the client asked for, or None (off)."""
    name = "top_logprobs" if chat else "logprobs"
    k = getattr(body, name)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}", field=name)
    if not chat:
        return k
    if k and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", field="top_logprobs")
    return (k or 0) if body.logprobs else None


MAX_TOKEN_ID_DIGITS = 10  # every vocabulary fits; int() of a 5,000-digit string raises


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        # isascii: str.isdigit() accepts "²" and "①", which int() refuses
        if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
            raise InvalidRequest(f"logit_bias keys must be token ids written as plain ASCII digits (at most "
                                 f"{MAX_TOKEN_ID_DIGITS}), got {key[:24]!r}{'...' if len(key) > 24 else ''}",
                                 field="logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"logit_bias: token id {bad} outside 0..{vocab_size - 1}", field="logit_bias")


def check_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens < 1:
        raise InvalidRequest("prompt is empty: it must contain at least one token", field="prompt")
    if num_prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLong(
            f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: together "
            f"{num_prompt_tokens + max_tokens}, more than the maximum context length {max_model_len}; "
            f"shorten the prompt or lower max_tokens", field="max_tokens")
