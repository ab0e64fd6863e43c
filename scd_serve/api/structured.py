"""Structured outputs: a request's constraint fields -> one GrammarSpec, compiled off the loop.

OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's extensions
(`structured_outputs.{json, regex, choice, grammar, json_object}`, and the older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`) all name one grammar; more than one is a
400. A chat's `tool_choice` `required` or a named function is one too (api/tools.py). The
grammar is compiled by the backend's GrammarCompiler in a worker thread: an invalid schema,
regex or grammar is a 400 naming the field and what is wrong.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from scd_serve.engine.grammar import Grammar, GrammarSpec
from scd_serve.errors import InvalidRequest


def requested_specs(body) -> list[GrammarSpec]:
    """Every constraint the body asks for (the route refuses more than one)."""
    specs = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        specs.append(GrammarSpec("json_object", field="response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequest("response_format.json_schema is required with type json_schema: "
                                 "{\"name\": ..., \"schema\": {...}}", field="response_format.json_schema")
        schema = fmt.json_schema.schema_
        specs.append(GrammarSpec("json_object", field="response_format") if schema is None
                     else GrammarSpec.json_schema(schema, "response_format.json_schema.schema"))
    so = body.structured_outputs
    if so is not None:
        given = so.model_dump(exclude_none=True, by_alias=True)
        if len(given) != 1:
            raise InvalidRequest("structured_outputs must hold exactly one of json, regex, choice, grammar, "
                                 f"json_object; got {sorted(given) or 'none'}", field="structured_outputs")
        (kind, value), = given.items()
        specs.append(_spec(kind, value, f"structured_outputs.{kind}"))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            specs.append(_spec(kind, value, f"guided_{kind}"))
    return specs


def _spec(kind: str, value: Any, field: str) -> GrammarSpec:
    """vLLM's (kind, value) -> a GrammarSpec; `field` names it in a 400."""
    if kind == "json_object" or (kind == "json" and value is True):  # `json: true`: any JSON object
        if value is not True:
            raise InvalidRequest(f"{field} must be true when given", field=field)
        return GrammarSpec("json_object", field=field)
    if kind == "json":
        return GrammarSpec.json_schema(value, field)
    if kind == "choice":
        if not value or any(not c for c in value):
            raise InvalidRequest(f"{field} must be a non-empty list of non-empty strings", field=field)
        return GrammarSpec("choice", json.dumps(value, ensure_ascii=False), field)
    if not value:
        raise InvalidRequest(f"{field} is empty", field=field)
    return GrammarSpec("regex" if kind == "regex" else "ebnf", value, field)


def one_spec(specs: list[GrammarSpec]) -> GrammarSpec | None:
    if len(specs) > 1:
        raise InvalidRequest("only one output constraint per request: got " + ", ".join(s.field for s in specs),
                             field=specs[1].field)
    return specs[0] if specs else None


async def compile_grammar(backend, spec: GrammarSpec | None) -> Grammar | None:
    """The spec's compiled grammar (in a worker thread: a big schema compiles for a while)."""
    if spec is None:
        return None
    grammars = getattr(backend, "grammars", None)
    if grammars is None:
        raise InvalidRequest(f"{spec.field}: this server's backend has no structured outputs", field=spec.field)
    return await asyncio.to_thread(grammars.compile, spec)
