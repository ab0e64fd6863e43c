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
        given = so.model_dump(exclude_none=True)
        if len(given) != 1:
            raise InvalidRequest("structured_outputs must hold exactly one of json, regex, choice, grammar, "
                                 f"json_object; got {sorted(given) or 'none'}", field="structured_outputs")
        specs.append(_one("structured_outputs", so.json_, so.regex, so.choice, so.grammar, so.json_object))
    for name, value in (("guided_json", body.guided_json), ("guided_regex", body.guided_regex),
                        ("guided_choice", body.guided_choice), ("guided_grammar", body.guided_grammar)):
        if value is not None:
            kind = name.removeprefix("guided_")
            specs.append(_one(name, *(value if k == kind else None for k in ("json", "regex", "choice", "grammar"))))
    return specs


def _one(field: str, schema: Any, regex: str | None, choice: list[str] | None, grammar: str | None,
         json_object: bool | None = None) -> GrammarSpec:
    where = field if field.startswith("guided_") else None
    if schema is not None:
        if schema is True:  # vLLM's structured_outputs.json: true is any JSON object
            return GrammarSpec("json_object", field=where or f"{field}.json")
        return GrammarSpec.json_schema(schema, where or f"{field}.json")
    if regex is not None:
        if not regex:
            raise InvalidRequest(f"{where or field + '.regex'} is empty", field=where or f"{field}.regex")
        return GrammarSpec("regex", regex, where or f"{field}.regex")
    if choice is not None:
        at = where or f"{field}.choice"
        if not choice or any(not c for c in choice):
            raise InvalidRequest(f"{at} must be a non-empty list of non-empty strings", field=at)
        return GrammarSpec("choice", json.dumps(choice, ensure_ascii=False), at)
    if grammar is not None:
        return GrammarSpec("ebnf", grammar, where or f"{field}.grammar")
    if json_object:
        return GrammarSpec("json_object", field=f"{field}.json_object")
    raise InvalidRequest(f"{field}.json_object must be true when it is the only field", field=f"{field}.json_object")


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
