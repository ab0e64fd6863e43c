"""Your own prompts for `calibrate --data FILE` and `eval --data FILE`: a file -> token ids.

A file ending in .jsonl or .ndjson holds one JSON object per line (blank lines are skipped):
  {"text": "..."}                        a document: the first half of its tokens is the prompt,
                                         the second half is scored (KL, perplexity)
  {"prompt": "..."}                      a prompt alone: the oracle's greedy continuation is scored
  {"prompt": "...", "answer": "..."}     the answer is scored and is the F1/EM reference
  {"messages": [{"role", "content"}...]} rendered through the consumer's chat template as the
                                         server renders chat (api/prompt.py); a last "assistant"
                                         message is the answer, the rest the prompt
An "id" key may ride along, and a "source" (the document or file the record comes from:
calibration's held-out splits keep every source whole); any other key is an error naming
its line. Any other file is plain
text: one document per paragraph (paragraphs are separated by blank lines; a paragraph's lines
stay one document), each read like {"text"}.

Truncation (`--max-tokens N`): a record longer than N tokens (prompt + answer) keeps its LAST N
tokens: the prompt loses its start (a leading BOS stays), an answer over N/2 tokens loses its
end; a document is cut before it is halved. Truncated records are counted, never refused.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scd_serve.errors import ConfigError, ScdError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
SHAPES = ({"text"}, {"prompt"}, {"prompt", "answer"}, {"messages"})
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Record:
    where: str  # "file:LINE", for messages
    kind: str  # "text" | "prompt" | "messages"
    text: str = ""  # the document or the prompt
    answer: str | None = None
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)
    source: str = ""  # the document it comes from ("": its own)


@dataclass
class Prompt:
    ids: torch.Tensor  # [T] long: tokens 0..T-2 are transferred, T-1 the consumer runs itself
    reference: torch.Tensor | None  # [m] long, scored after the prompt; None: nothing given
    answer: str | None  # F1/EM reference text
    kind: str
    where: str
    source: str = ""  # the record's document ("": its own, named by `where`)

    @property
    def document(self) -> str:
        return self.source or self.where


@dataclass
class Prompts:
    path: str
    items: list[Prompt]
    max_tokens: int
    num_truncated: int
    num_skipped: int  # too short to transfer (under 2 prompt tokens)

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(Counter(p.kind for p in self.items).items()))
        line = (f"data: {self.path}: {len(self.items)} prompts ({kinds}); {self.num_truncated} truncated "
                f"to their last {self.max_tokens} tokens")
        return line + (f"; {self.num_skipped} skipped (under 2 prompt tokens)" if self.num_skipped else "")


FORMATS_HELP = ('.jsonl/.ndjson lines of {"text"}, {"prompt"[, "answer"]} or {"messages"} (chat template), '
                'or plain text with one document per blank-line-separated paragraph')


def add_truncation_arguments(parser: Any, greedy_help: str) -> None:
    """--max-tokens and --greedy-tokens, as calibrate and eval both take them with --data FILE."""
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="with --data FILE: tokens per record (prompt + answer); longer records keep their "
                             "LAST N tokens (a leading BOS stays) and are counted as truncated "
                             "(default: the models' context minus --greedy-tokens)")
    parser.add_argument("--greedy-tokens", type=int, default=16, help=f"with --data FILE: {greedy_help}")


def read_records(path: str | Path) -> list[Record]:
    """Parse and check the file (no tokenizer needed): ConfigError naming the line on bad input."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--data {p}: no such file", field="data")
    if not p.is_file():
        raise ConfigError(f"--data {p}: not a file", field="data")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--data {p}: not UTF-8 text (byte {exc.start})", field="data") from None
    records = _jsonl(p, text) if p.suffix.lower() in JSONL_SUFFIXES else _paragraphs(p, text)
    if not records:
        raise ConfigError(f"--data {p}: no records (the file is empty or blank)", field="data")
    return records


def _paragraphs(p: Path, text: str) -> list[Record]:
    out, lines, start = [], [], 0
    for n, line in enumerate(text.splitlines() + [""], 1):
        if line.strip():
            start = start or n
            lines.append(line)
        elif lines:
            out.append(Record(f"{p}:{start}", "text", "\n".join(lines)))
            lines, start = [], 0
    return out


def _jsonl(p: Path, text: str) -> list[Record]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--data {where}: not valid JSON ({exc.msg} at column {exc.colno})",
                              field="data") from None
        out.append(_record(where, obj))
    return out


def _record(where: str, obj: Any) -> Record:
    def bad(msg: str) -> ConfigError:
        return ConfigError(f"--data {where}: {msg}", field="data")

    if not isinstance(obj, dict):
        raise bad(f"expected a JSON object, got {type(obj).__name__}")
    keys = set(obj) - {"id", "source"}
    if keys not in SHAPES:
        unknown = sorted(keys - {"text", "prompt", "answer", "messages"})
        what = f"unknown key(s) {unknown}" if unknown else f"keys {sorted(keys)} do not go together"
        raise bad(f"{what}; expected {{\"text\"}}, {{\"prompt\"[, \"answer\"]}} or {{\"messages\"}} "
                  "(and an optional \"id\" and \"source\")")
    source = obj.get("source", "")
    if not isinstance(source, str):
        raise bad("\"source\" must be a string (the record's document or file)")
    for key in keys - {"messages"}:
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise bad(f"\"{key}\" must be a non-empty string")
    if "text" in keys:
        return Record(where, "text", obj["text"], source=source)
    if "prompt" in keys:
        return Record(where, "prompt", obj["prompt"], obj.get("answer"), source=source)
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise bad("\"messages\" must be a non-empty list of {\"role\", \"content\"}")
    pairs = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise bad(f"messages[{i}] must be {{\"role\": one of {'/'.join(ROLES)}, \"content\": a string}}")
        pairs.append((m["role"], m["content"]))
    answer = None
    if pairs[-1][0] == "assistant":
        if len(pairs) == 1:
            raise bad("messages hold only the assistant's answer; nothing to prompt with")
        answer, pairs = pairs[-1][1], pairs[:-1]
    return Record(where, "messages", answer=answer, messages=tuple(pairs), source=source)


def tokenize(records: list[Record], tokenizer: Any, max_tokens: int, path: str = "") -> Prompts:
    """Records -> prompts of token ids under `max_tokens` (see the module doc)."""
    if tokenizer is None:
        raise ConfigError("the consumer model directory has no tokenizer; --data FILE needs one", field="data")
    if max_tokens < 4:
        raise ConfigError(f"--max-tokens must be >= 4, got {max_tokens}", field="max_tokens")
    bos = getattr(tokenizer, "bos_token_id", None)
    items, truncated, skipped = [], 0, 0
    for r in records:
        ref, answer = None, None
        if r.kind == "text":
            ids, cut = keep_last(_encode(tokenizer, r.text, True), max_tokens, bos)
            half = max(2, len(ids) // 2)
            ids, ref = ids[:half], ids[half:] or None
        else:
            ids = _encode(tokenizer, r.text, True) if r.kind == "prompt" else _chat(tokenizer, r)
            ref = _encode(tokenizer, r.answer, False) if r.answer else None
            answer = r.answer
            cut = bool(ref) and len(ref) > max_tokens // 2
            if cut:  # the F1/EM reference is what is left of the answer
                ref = ref[: max_tokens // 2]
                answer = tokenizer.decode(ref, skip_special_tokens=True)
            ref, answer = (ref, answer) if ref else (None, None)
            ids, cut_prompt = keep_last(ids, max_tokens - len(ref or []), bos)
            cut = cut or cut_prompt
        truncated += cut
        if len(ids) < 2:
            skipped += 1
            continue
        items.append(Prompt(torch.tensor(ids, dtype=torch.long),
                            torch.tensor(ref, dtype=torch.long) if ref else None, answer, r.kind, r.where,
                            r.source))
    if not items:
        raise ConfigError(f"--data {path}: no record has the 2 prompt tokens a transfer needs", field="data")
    return Prompts(path, items, max_tokens, truncated, skipped)


def keep_last(ids: list[int], n: int, bos: int | None) -> tuple[list[int], bool]:
    """The last `n` tokens of `ids`, a leading BOS kept in front. -> (ids, truncated)."""
    if len(ids) <= n:
        return ids, False
    if bos is not None and ids and ids[0] == bos and n > 1:
        return [bos] + ids[len(ids) - n + 1:], True
    return ids[len(ids) - n:], True


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _chat(tokenizer: Any, r: Record) -> list[int]:
    from scd_serve.api.prompt import chat_prompt_ids
    from scd_serve.api.schemas import ChatMessage

    try:
        return chat_prompt_ids([ChatMessage(role=role, content=c) for role, c in r.messages], tokenizer)
    except ScdError as exc:
        raise ConfigError(f"--data {r.where}: {exc.message}", field="data") from None


def read_prompts(path: str | Path, tokenizer: Any, max_tokens: int) -> Prompts:
    return tokenize(read_records(path), tokenizer, max_tokens, str(path))
