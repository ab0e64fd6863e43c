"""Structured outputs: a request's grammar, compiled once per spec, and the batched token mask.

xgrammar (vLLM's default backend) does the grammar work: `GrammarCompiler.compile(spec)` turns
a JSON schema, a regex, a list of choices or an EBNF grammar into a `Grammar` (an LRU cache
keyed by the spec; the API calls it in a worker thread, never on the engine thread or the
event loop). Each sequence holds its own matcher (`Grammar.matcher()`), advanced by the
tokens it is given. `TokenMask` is the sampler's half: one preallocated bitmask, filled for
every constrained row of a step by xgrammar's thread pool and applied to the logits in one
call, then one call to advance the matchers; no Python loop over rows.

A preempted sequence keeps its output tokens (the engine recomputes their K/V), and its
matcher has accepted exactly those tokens, so the matcher stays valid: nothing to roll back.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field as dc_field
from typing import Any

import torch

from scd_serve.errors import InvalidRequest

KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf")
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")  # "[12:00:01] file.cc:83: "


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. `text`: the schema as JSON, the regex, the
    choices as a JSON list, or the EBNF grammar; `field`: the request field that asked (400s)."""

    kind: str
    text: str = ""
    field: str = dc_field(default="response_format", compare=False)  # not part of the cache key

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: Any, field: str) -> GrammarSpec:
        """A schema given as an object or as JSON text (400 naming `field` if it is neither)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequest(f"{field}: the schema is not valid JSON ({exc})", field=field) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(f"{field}: a JSON schema must be an object, got {type(schema).__name__}",
                                 field=field)
        # key order kept: properties are written in the order the schema declares them
        return cls("json_schema", json.dumps(schema, ensure_ascii=False), field)


class Grammar:
    """One compiled grammar, shared (read-only) by every request with the same spec."""

    def __init__(self, spec: GrammarSpec, compiled: Any):
        self.spec, self.compiled = spec, compiled

    def matcher(self) -> Any:
        return _xgrammar().GrammarMatcher(self.compiled)


class GrammarCompiler:
    """Specs -> Grammars for one tokenizer (the model's logits width, its stop tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int], *,
                 json_whitespace: int = 16, cache_size: int = 256, threads: int = 2):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        # between JSON elements a small model can emit blanks without end: at most this many (0: none)
        self.json = ({"any_whitespace": True, "max_whitespace_cnt": json_whitespace} if json_whitespace
                     else {"any_whitespace": False})
        self.cache_size, self.threads = cache_size, threads
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._compiler: Any = None
        self.num_compiled = self.num_hits = 0

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The spec's Grammar, compiled on first use (seconds at most; call it off the event loop).
        400 naming spec.field when the spec is invalid, or when no token of this vocabulary can
        start the output it allows."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.num_hits += 1
                return hit
        grammar = Grammar(spec, self._compile(spec))
        _check_startable(grammar, self.vocab_size)
        with self._lock:
            self._cache[spec] = grammar
            self.num_compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler = self._xgr_compiler()
        try:
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **self.json)
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(json.dumps(_lengths_as_patterns(json.loads(spec.text))),
                                                    **self.json)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "choice":
                alternatives = json.loads(spec.text)
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                         for c in alternatives))
            return compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError) as exc:  # xgrammar's errors: bad schema, regex or grammar
            what = {"json_schema": "JSON schema", "ebnf": "grammar (EBNF)"}.get(spec.kind, spec.kind)
            raise InvalidRequest(f"{spec.field}: invalid {what}: {_xgr_message(exc)}", field=spec.field) from None

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:  # the vocabulary is read once, on the first structured request
                xgr = _xgrammar()
                # (no stop ids given: xgrammar looks for the tokenizer's own; a grammar without any
                # ends its sequence when complete, sampler.Ended)
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                # the compiler's own cache is off: ours (above) is bounded and counted
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
            return self._compiler


# One character of valid UTF-8 by its code point ranges (no controls, no surrogates, no `"` or
# `\`, which would need escapes): xgrammar's `.` also admits overlong byte sequences, which
# decode to U+FFFD and break maxLength. One class, not alternatives: those cost 30x per mask.
_CHAR = "[ !#-\\[\\]-~\u0080-\ud7ff\ue000-\U0010ffff]"
_DATA = ("enum", "const", "default", "examples")  # values, not schemas: left untouched


def _lengths_as_patterns(schema: Any) -> Any:
    """xgrammar 0.2.8 lets a string with minLength/maxLength hold raw control characters (not
    JSON); the same bounds as a pattern of valid characters keep them out. Such a string then
    holds no `"`, `\\` or escapes, a small loss. Strings with a pattern or a format are left alone."""
    if isinstance(schema, list):
        return [_lengths_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA else _lengths_as_patterns(v) for k, v in schema.items()}
    lo, hi = out.get("minLength", 0), out.get("maxLength", "")
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out) and "pattern" not in out
            and "format" not in out and all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi or 0))):
        out.pop("minLength", None), out.pop("maxLength", None)
        out["pattern"] = f"^{_CHAR}{{{lo},{hi}}}$"
    return out


def _xgr_message(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGR_PREFIX.sub("", first)[:300]


def _check_startable(grammar: Grammar, vocab_size: int) -> None:
    """A vocabulary without the characters a format needs (a word-level one has no `{`) would
    leave the first step with no legal token: say so at once instead."""
    bitmask = _xgrammar().allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab/32)] int32
    grammar.matcher().fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()):
        spec = grammar.spec
        raise InvalidRequest(f"{spec.field}: this model's vocabulary has no token that can begin output of this "
                             f"format ({spec.kind}); the model cannot write it", field=spec.field)


class TokenMask:
    """The sampler's mask over constrained rows: fill (xgrammar's threads), apply, advance."""

    def __init__(self) -> None:
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab/32)] int32 on the CPU, grown on demand
        self._batch: Any = None

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> list[int]:
        """logits [B, vocab], masked in place at `rows` (matchers[j] is row rows[j]'s).
        -> the rows whose grammar allows no token at all (an empty mask)."""
        xgr = _xgrammar()
        b, vocab = logits.shape
        if self._bitmask is None or self._bitmask.shape[0] < b or self._bitmask.shape[1] * 32 < vocab:
            self._bitmask = xgr.allocate_token_bitmask(max(b, 8), vocab)
            self._batch = self._batch or xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, self._bitmask, indices=rows)
        self.reapply(logits, rows)
        empty = (~self._bitmask[rows].bool().any(dim=-1)).tolist()  # [len(rows)]: a few hundred ints a row
        return [r for r, e in zip(rows, empty, strict=True) if e]

    def reapply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """The mask last filled, applied again to `rows` (whose logits were replaced)."""
        bitmask = self._bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
        _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)

    @staticmethod
    def accept(matchers: list[Any], tokens: list[int]) -> list[bool]:
        """Advance each matcher by its row's token; False where the grammar refused it."""
        return list(_xgrammar().BatchGrammarMatcher.batch_accept_token(matchers, tokens))


_XGR: Any = None


def _xgrammar() -> Any:
    """xgrammar, imported on first use (seconds: only servers that meet a grammar pay it)."""
    global _XGR
    if _XGR is None:
        import xgrammar

        _XGR = xgrammar
    return _XGR
