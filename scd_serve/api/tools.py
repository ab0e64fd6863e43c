"""Tool calls: `tools` + `tool_choice` -> a ToolPlan (the grammar, the parser, the prompt's tools).

- `none`: the tools go into the prompt, the reply is text;
- `auto` (the default with tools): the reply is free; vLLM's hermes parser finds
  `<tool_call>{"name", "arguments"}</tool_call>` blocks in it (api/tool_calls.py);
- `required`: the reply is constrained to a JSON array of one or more `{"name", "parameters"}`
  of the given tools, each `parameters` by its function's schema (vLLM's grammar for it);
  `parallel_tool_calls: false` allows one;
- a named function: the reply is constrained to that function's parameters schema.

The chat template gets the tools (`tools=`) when it uses them; otherwise, and for the default
template, a system message lists them in hermes style and says how to call one. Earlier turns'
assistant `tool_calls` and `tool` messages are rendered the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from scd_serve.api.tool_calls import CLOSE, OPEN, ToolCallParser
from scd_serve.engine.grammar import GrammarSpec
from scd_serve.errors import InvalidRequest

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    functions: tuple[dict[str, Any], ...]  # OpenAI function definitions (name, description, parameters)
    name: str | None = None  # mode "named": the function
    parallel: bool = True

    def spec(self) -> GrammarSpec | None:
        if self.mode == "named":
            i, fn = next((i, f) for i, f in enumerate(self.functions) if f["name"] == self.name)
            return GrammarSpec.json_schema(fn.get("parameters") or ANY_OBJECT, f"tools.{i}.function.parameters")
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                   "parameters": f.get("parameters") or ANY_OBJECT},
                  "required": ["name", "parameters"]} for f in self.functions]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({} if self.parallel else
                                                                                {"maxItems": 1})
        return GrammarSpec.json_schema(schema, "tools")

    def parser(self) -> ToolCallParser | None:
        return None if self.mode == "none" else ToolCallParser(self.mode, self.name)

    def finish_reason(self, finish: str | None, parser: ToolCallParser) -> str | None:
        """OpenAI's: `tool_calls` when calls were made (a forced named call says `stop`)."""
        if finish == "stop" and parser.calls and self.mode != "named":
            return "tool_calls"
        return finish

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f} for f in self.functions]


def tool_plan(body) -> ToolPlan | None:
    """The request's tools and tool_choice, checked (400 naming the field), or None."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools: send the functions it may call in `tools`",
                                 field="tool_choice")
        return None
    functions = tuple(t.function.model_dump(exclude_none=True) for t in body.tools)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"tools: function names must be unique, got {names}", field="tools")
    if choice is None or isinstance(choice, str):
        return ToolPlan(choice or "auto", functions, parallel=body.parallel_tool_calls is not False)
    if choice.function.name not in names:
        raise InvalidRequest(f"tool_choice names function {choice.function.name!r}, which is not in tools "
                             f"({', '.join(names)})", field="tool_choice.function.name")
    return ToolPlan("named", functions, choice.function.name)


def hermes_system_prompt(functions: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> str:
    """The tools and how to call them, as hermes-style models are trained to read it."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return ("You may call one or more functions to help with the user's request. The functions, in "
            f"<tools></tools>:\n<tools>\n{listed}\n</tools>\nTo call one, write a JSON object with its name and "
            f"arguments within {OPEN}{CLOSE} tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE)


def hermes_calls(tool_calls: list[dict[str, Any]]) -> str:
    """An earlier assistant turn's calls, as the model would have written them."""
    return "\n".join(f"{OPEN}\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                               ensure_ascii=False) + f"\n{CLOSE}" for c in tool_calls)


def parsed_arguments(arguments: str) -> Any:
    """A call's arguments (JSON text) as chat templates want them (an object), else the text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
