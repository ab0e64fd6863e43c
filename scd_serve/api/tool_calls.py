"""Generated text -> `content` and `tool_calls`, whole or as it streams (one parser per choice).

Three shapes, one per `tool_choice`:
- a named function: the text *is* the arguments (its grammar is the function's parameters);
- `required`: the text is a JSON array of `{"name", "parameters"}` (vLLM's grammar for it);
  each call is sent once its object closes;
- `auto`: vLLM's hermes parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  anywhere in the text; the text around it is content; a block that is not such JSON stays
  content. Text that might open a tag is held back until it is known not to.

`feed(text)` and `end()` return the deltas to stream (`{"content": ...}` or `{"tool_calls": [...]}`,
OpenAI's chunk shapes); after `end()`, `content` and `calls` hold the whole message.
"""

from __future__ import annotations

import json
import uuid
from contextlib import suppress
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex[:24]


class ToolCallParser:
    def __init__(self, mode: str, name: str | None = None):
        if mode not in ("named", "required", "auto"):
            raise ValueError(f"tool parser mode must be named, required or auto, got {mode!r}")
        self.mode, self.name = mode, name
        self.calls: list[dict[str, Any]] = []  # OpenAI's tool_calls entries, in order
        self._content: list[str] = []
        self._buf = ""  # text not yet sent (a possible tag, an open call, required's array)
        self._scan = _ObjectScanner()

    @property
    def content(self) -> str | None:
        text = "".join(self._content)
        return text if text.strip() or (text and not self.calls) else None

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        if self.mode == "named":
            return self._named(text)
        if self.mode == "required":
            return [self._call_delta(obj.get("name", ""), json.dumps(obj.get("parameters", {}), ensure_ascii=False))
                    for obj in self._scan.feed(text) if isinstance(obj, dict)]
        self._buf += text
        return self._auto(final=False)

    def end(self) -> list[dict]:
        return self._auto(final=True) if self.mode == "auto" else []

    # ------------------------------------------------------------------ the modes
    def _named(self, text: str) -> list[dict]:
        out = []
        if not self.calls:
            cid = call_id()
            self.calls.append({"id": cid, "type": "function", "function": {"name": self.name, "arguments": ""}})
            out.append({"tool_calls": [{"index": 0, "id": cid, "type": "function",
                                        "function": {"name": self.name, "arguments": ""}}]})
        self.calls[0]["function"]["arguments"] += text
        out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def _auto(self, final: bool) -> list[dict]:
        out = []
        while self._buf:
            start = self._buf.find(OPEN)
            if start < 0:  # no tag: everything but a possible tag prefix is content
                keep = 0 if final else _tag_prefix_len(self._buf, OPEN)
                out += self._say(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            out += self._say(self._buf[:start])
            self._buf = self._buf[start:]
            stop = self._buf.find(CLOSE)
            if stop < 0 and not final:
                break  # an open call: wait for its end
            body = self._buf[len(OPEN): stop if stop >= 0 else None]
            block, self._buf = (self._buf[: stop + len(CLOSE)], self._buf[stop + len(CLOSE):]) if stop >= 0 \
                else (self._buf, "")
            call = _hermes(body)
            out += [self._call_delta(*call)] if call else self._say(block)
        return out

    def _say(self, text: str) -> list[dict]:
        if not text:
            return []
        self._content.append(text)
        return [{"content": text}]

    def _call_delta(self, name: str, arguments: str) -> dict:
        self.calls.append({"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}})
        return {"tool_calls": [{"index": len(self.calls) - 1, **self.calls[-1]}]}


def _hermes(body: str) -> tuple[str, str] | None:
    """A <tool_call> block's JSON -> (name, arguments as JSON text), or None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _ObjectScanner:
    """The objects of a JSON array, each as soon as it closes (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.item = 0, False, False, []

    def feed(self, text: str) -> list[Any]:
        done = []
        for ch in text:
            if self.depth >= 2 or (self.depth == 1 and ch == "{"):
                self.item.append(ch)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}":
                    with suppress(ValueError):
                        done.append(json.loads("".join(self.item)))
                    self.item = []
        return done
