"""Structured outputs and tool calls through the official openai client, on a real server and
engine (a tiny random llama: what it writes is noise, but the grammar makes it valid)."""

import json

import jsonschema
import openai
import pytest
from api_server import ServerThread, engine_app, stop_engine
from structured_schemas import SCHEMAS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MAX = 400  # enough for every schema here (the longest reply measured: 280 tokens)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"]}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from scd_serve.model import ModelRuntime
    from scd_serve.model.tiny import save_tiny_model
    # 2048 positions: the tools' system prompt is 600-800 byte tokens
    rt = ModelRuntime.load(save_tiny_model(tmp_path_factory.mktemp("tiny-long"), "llama", max_position_embeddings=2048))
    app, engine = engine_app(rt, engine_kw={"max_model_len": 2048, "num_blocks": 1024},
                             api_kw={"max_tokens_cap": MAX})
    with ServerThread(app) as srv:
        yield srv
    stop_engine(engine)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, stream=False, **kw):
    kw = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Reply in JSON."}], "max_tokens": MAX,
          "temperature": 0} | kw  # greedy unless a test says otherwise: the same reply every run
    if not stream:
        return client.chat.completions.create(**kw)
    return list(client.chat.completions.create(stream=True, **kw))


def streamed_text(chunks):
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_replies_parse_and_validate_whole_and_streamed(client, i):
    schema = SCHEMAS[i]
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
    r = chat(client, response_format=fmt, temperature=1.0, seed=i)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    chunks = chat(client, stream=True, response_format=fmt, temperature=0)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(streamed_text(chunks)), schema)


def test_json_object_replies_are_objects_whole_and_streamed(client):
    # (any object: a random model may nest on past max_tokens; this seed's reply ends within them)
    r = chat(client, response_format={"type": "json_object"}, temperature=1.0, seed=3)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    chunks = chat(client, stream=True, response_format={"type": "json_object"}, temperature=1.0, seed=3)
    assert streamed_text(chunks) == r.choices[0].message.content  # seeded: the same reply, streamed


@pytest.mark.parametrize("extra,check", [
    ({"guided_json": SCHEMAS[3]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[3])),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit()),
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"structured_outputs": {"choice": ["x y", "z"]}}, lambda t: t in ("x y", "z")),
    ({"structured_outputs": {"json": SCHEMAS[10]}}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[10])),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, lambda t: t in ("yes", "no")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS[1]}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1])),
])
def test_completions_take_vllms_fields_and_response_format(client, extra, check):
    r = client.completions.create(model="tiny-llama", prompt="answer:", max_tokens=MAX, temperature=1.0, seed=1,
                                  extra_body=extra)
    assert r.choices[0].finish_reason == "stop"
    check(r.choices[0].text)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-llama", prompt="answer:", max_tokens=MAX, stream=True, temperature=0, extra_body=extra)
        if c.choices)
    check(text)


def test_max_tokens_running_out_mid_json_says_length(client):
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS[5]}},
             max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("body,field,says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema", "frob"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "parenthesis"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "guided_choice",
     "only one"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_constraints_are_400s_naming_the_field_and_the_problem(client, body, field, says):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **body)
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == field and says in err["message"], err


def validate_calls(calls, names):
    assert calls and all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in calls)
    for c in calls:
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


def streamed_calls(chunks):
    """delta.tool_calls chunks -> {index: (id, name, arguments)}, as clients assemble them."""
    calls: dict[int, list] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, [None, None, ""])
            entry[0] = d.id or entry[0]
            entry[1] = (d.function.name if d.function and d.function.name else None) or entry[1]
            entry[2] += (d.function.arguments or "") if d.function else ""
    return calls


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tool_choice_required_calls_validate_whole_and_streamed(client, seed):
    r = chat(client, tools=[WEATHER, CLOCK], tool_choice="required", temperature=1.0, seed=seed)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    validate_calls(msg.tool_calls, {"get_weather", "get_time"})
    chunks = chat(client, stream=True, tools=[WEATHER, CLOCK], tool_choice="required", temperature=1.0, seed=seed)
    calls = streamed_calls(chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and calls
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]  # seeded: the same calls


def test_a_named_tool_choice_calls_that_function_whole_and_streamed(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=[WEATHER, CLOCK], tool_choice=named, temperature=1.0, seed=5)
    assert r.choices[0].finish_reason == "stop"
    validate_calls(r.choices[0].message.tool_calls, {"get_weather"})
    calls = streamed_calls(chat(client, stream=True, tools=[WEATHER, CLOCK], tool_choice=named))
    (cid, name, args), = calls.values()
    assert cid and name == "get_weather"
    jsonschema.validate(json.loads(args), PARAMS["get_weather"])


HERMES = r'Checking\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}</tool_call>'


def test_auto_parses_hermes_tool_calls_out_of_the_text_whole_and_streamed(client):
    # the random model never writes a call by itself: a regex makes it write one, the parser finds it
    r = chat(client, tools=[WEATHER, CLOCK], extra_body={"guided_regex": HERMES})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking. "
    validate_calls(msg.tool_calls, {"get_time"})
    chunks = chat(client, stream=True, tools=[WEATHER, CLOCK], tool_choice="auto", extra_body={"guided_regex": HERMES})
    assert streamed_text(chunks) == "Checking. " and chunks[-1].choices[0].finish_reason == "tool_calls"
    (_, name, args), = streamed_calls(chunks).values()
    assert name == "get_time" and json.loads(args)["zone"] in ("utc", "cet")


def test_auto_without_a_call_is_plain_text_and_none_never_parses(client):
    r = chat(client, tools=[WEATHER], max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    r = chat(client, tools=[CLOCK], tool_choice="none", extra_body={"guided_regex": HERMES})
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_the_next_turn_takes_the_calls_and_the_tool_results(client):
    first = chat(client, tools=[WEATHER], tool_choice="required", temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r = chat(client, messages=messages, tools=[WEATHER], max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens > 60
