"""Tool calls without a model: the parsers (whole = streamed in any pieces), the plans, the prompt."""

import json

import pytest

from scd_serve.api.prompt import chat_prompt_ids
from scd_serve.api.schemas import ChatCompletionRequest, ChatMessage
from scd_serve.api.tool_calls import ToolCallParser
from scd_serve.api.tools import tool_plan
from scd_serve.errors import InvalidRequest
from scd_serve.testing.fake_runtime import byte_tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
AUTO_TEXT = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
             ' then <tool_call>{not json}</tool_call> and <tool_call>{"name": "get_weather", "arguments": "{}"}')


def run(parser, text, step):
    deltas = [d for i in range(0, len(text), step) for d in parser.feed(text[i:i + step])] + parser.end()
    return deltas, parser


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_auto_parses_hermes_blocks_whatever_the_pieces(step):
    deltas, p = run(ToolCallParser("auto"), AUTO_TEXT, step)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {})]  # the unterminated last block parses too
    assert p.content == "Let me look.  then <tool_call>{not json}</tool_call> and "  # a bad block stays text
    assert "".join(d.get("content", "") for d in deltas) == p.content
    assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == [0, 1]


def test_auto_holds_back_what_may_open_a_tag_and_sends_it_once_it_cannot():
    p = ToolCallParser("auto")
    assert p.feed("a <tool") == [{"content": "a "}]
    assert p.feed("box>") == [{"content": "<toolbox>"}]
    assert p.end() == [] and p.calls == [] and p.content == "a <toolbox>"


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_required_sends_each_call_as_its_object_closes(step):
    text = '[{"name": "a", "parameters": {"s": "}{\\"]"}}, {"name": "b", "parameters": {"n": [1, {"x": 2}]}}]'
    deltas, p = run(ToolCallParser("required"), text, step)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.calls] == [
        ("a", {"s": '}{"]'}), ("b", {"n": [1, {"x": 2}]})]
    assert len(deltas) == 2 and p.content is None


def test_a_named_call_streams_its_arguments_after_a_header():
    p = ToolCallParser("named", "f")
    deltas = p.feed('{"a"') + p.feed(": 1}") + p.end()
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"a": 1}'
    assert p.calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def body(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw)


def test_plans_and_their_grammars():
    assert tool_plan(body()) is None and tool_plan(body(tool_choice="none")) is None
    assert tool_plan(body(tools=[TOOL])).mode == "auto" and tool_plan(body(tools=[TOOL])).spec() is None
    required = json.loads(tool_plan(body(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)).spec().text)
    assert required["maxItems"] == 1 and required["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    named = tool_plan(body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(named.spec().text) == TOOL["function"]["parameters"]
    assert named.spec().field == "tools.0.function.parameters"


@pytest.mark.parametrize("kw,field", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice.function.name"),
])
def test_inconsistent_tools_are_400s(kw, field):
    with pytest.raises(InvalidRequest) as e:
        tool_plan(body(**kw))
    assert e.value.field == field


CONVERSATION = [ChatMessage(role="user", content="weather?"),
                ChatMessage(role="assistant", content=None, tool_calls=[
                    {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]),
                ChatMessage(role="tool", tool_call_id="c1", content="rain")]


def test_the_default_template_lists_the_tools_and_replays_calls_and_results():
    tok = byte_tokenizer()
    text = tok.decode(chat_prompt_ids(CONVERSATION, tok, tools=[TOOL]))
    assert text.startswith("<|system|>\n") and '"name": "get_weather"' in text.split("<tools>\n")[1].split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|tool|>\nrain\n" in text and text.endswith("<|assistant|>\n")


def test_a_template_with_tool_support_gets_the_tools_and_one_without_gets_them_in_a_system_turn():
    tok = byte_tokenizer()
    with_tools = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}"
                  "{{ m.role }}:{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.city }}"
                  "{% endif %};{% endfor %}")
    text = tok.decode(chat_prompt_ids(CONVERSATION, tok, tools=[TOOL], chat_template=with_tools))
    assert text.startswith("[tool get_weather]user:weather?;assistant:Oslo;tool:rain;")  # arguments as an object
    plain = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    text = tok.decode(chat_prompt_ids(CONVERSATION, tok, tools=[TOOL], chat_template=plain))
    assert text.startswith("system:You may call") and "<tools>" in text
