"""Prompt -> token ids: plain completions, and chat messages through a chat template.

When the tokenizer has no chat template, DEFAULT_CHAT_TEMPLATE is used: each message as
`<|role|>\\ncontent\\n`, then `<|assistant|>\\n` to open the reply. It is plain text, so it
works with any tokenizer (a byte-level one included). Tools, and earlier turns' tool calls,
are written hermes-style where the template does not take them (api/tools.py).
"""

from __future__ import annotations

from typing import Any

from scd_serve.api.schemas import ChatMessage
from scd_serve.api.tools import hermes_calls, hermes_system_prompt, parsed_arguments
from scd_serve.errors import InvalidRequest

UNKNOWN_SHARE = 0.5  # a prompt with more of its tokens unknown than this reads as noise to the model
DEFAULT_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
DEFAULT_GENERATION_PROMPT = "<|assistant|>\n"


def completion_prompts(prompt: str | list, tokenizer: Any, vocab_size: int) -> list[tuple[str | None, list[int]]]:
    """OpenAI's four prompt forms (a string, token ids, a list of either) -> (text, ids) per
    prompt; text is None for token ids (echo decodes them)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return [_one_prompt(p, tokenizer, vocab_size, f"prompt.{i}") for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, tokenizer, vocab_size, "prompt")]


def _one_prompt(prompt: str | list, tokenizer: Any, vocab_size: int, where: str) -> tuple[str | None, list[int]]:
    if isinstance(prompt, list):  # token ids
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{where}: token id {bad} outside 0..{vocab_size - 1}", field="prompt")
        if not prompt:
            raise InvalidRequest(f"{where} is empty", field="prompt")
        return None, list(prompt)
    if not prompt:
        raise InvalidRequest(f"{where} is empty", field="prompt")
    return prompt, encode(tokenizer, prompt, add_special_tokens=True, field="prompt")


def chat_prompt_ids(messages: list[ChatMessage], tokenizer: Any, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, *, tools: list[dict[str, Any]] | None = None,
                    chat_template: str | None = None) -> list[int]:
    """`tools`: OpenAI's tool list ({"type": "function", "function": {...}}), for the template.
    `chat_template`: the server's (--chat-template), else the tokenizer's, else the default."""
    plain = [_plain(m) for m in messages]
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if tools and not (template and "tools" in template):  # no tool support in the template: say it ourselves
        plain = _with_system(plain, hermes_system_prompt([t["function"] for t in tools]))
        tools = None
    if template:
        try:
            text = tokenizer.apply_chat_template(plain, tools=tools, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - templates reject roles/orders with raise_exception()
            raise InvalidRequest(f"messages do not fit the model's chat template: {str(exc)[:200]}",
                                 field="messages") from None
    else:
        text = "".join(DEFAULT_CHAT_TEMPLATE.format(role=m["role"], content=_default_content(m)) for m in plain)
        text += DEFAULT_GENERATION_PROMPT if add_generation_prompt else ""
    # the template already holds any BOS it wants
    return encode(tokenizer, text, add_special_tokens=add_special_tokens, field="messages")


def _plain(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it (calls' arguments as objects, as HF templates expect)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content if isinstance(m.content, str)
                           else "".join(part.text for part in m.content or ())}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                                  "name": c.function.name, "arguments": parsed_arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _default_content(m: dict[str, Any]) -> str:
    calls = m.get("tool_calls")
    return m["content"] + ("\n" if m["content"] and calls else "") + (hermes_calls(calls) if calls else "")


def _with_system(plain: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if plain and plain[0]["role"] == "system":
        return [plain[0] | {"content": plain[0]["content"] + "\n\n" + text}, *plain[1:]]
    return [{"role": "system", "content": text}, *plain]


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool, field: str) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{field} is not valid Unicode text (it holds a lone surrogate)", field=field) from None
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def unknown_warning(prompts: list[tuple[str | None, list[int]]], tokenizer: Any) -> str | None:
    """A warning when most prompt tokens (special ones aside) are the tokenizer's unknown token:
    text outside the model's vocabulary (a word-level one), which it cannot read. None otherwise."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return None
    special = set(getattr(tokenizer, "all_special_ids", ())) - {unk}
    counted = [t for _, ids in prompts for t in ids if t not in special]
    unknown = sum(t == unk for t in counted)
    if not counted or unknown <= UNKNOWN_SHARE * len(counted):
        return None
    return (f"{unknown} of {len(counted)} prompt tokens are unknown to this model's vocabulary "
            f"({tokenizer.unk_token}): it cannot read the prompt and its answer is noise; "
            f"POST /tokenize shows how it reads a text")
