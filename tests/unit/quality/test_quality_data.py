"""Reading your own prompts: the three JSONL shapes, plain-text paragraphs, truncation, bad input."""

import json

import pytest

from scd_serve.api.prompt import chat_prompt_ids
from scd_serve.api.schemas import ChatMessage
from scd_serve.errors import ConfigError
from scd_serve.model.tiny import byte_tokenizer
from scd_serve.quality.data import keep_last, read_prompts, read_records, tokenize


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer(256)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_three_jsonl_shapes(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "a", "text": "abcdefgh"},
        {"prompt": "hello", "answer": "xy"},
        "",  # blank lines are skipped
        {"prompt": "hi there"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "ok"}]},
        {"messages": [{"role": "user", "content": "hi"}]},
    ])
    recs = read_records(f)
    assert [r.kind for r in recs] == ["text", "prompt", "prompt", "messages", "messages"]
    assert recs[1].where.endswith("d.jsonl:2") and recs[2].where.endswith("d.jsonl:4")
    ps = tokenize(recs, tok, 100, str(f))
    text, qa, alone, chat, chat_alone = ps.items
    assert text.ids.tolist() == ids(tok, "abcd") and text.reference.tolist() == ids(tok, "efgh") and text.answer is None
    assert qa.ids.tolist() == ids(tok, "hello") and qa.reference.tolist() == ids(tok, "xy") and qa.answer == "xy"
    assert alone.reference is None and alone.answer is None
    # the chat prompt is exactly what the server renders; the last assistant turn is the answer
    msgs = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
    assert chat.ids.tolist() == chat_prompt_ids(msgs, tok) and chat.answer == "ok"
    assert chat.reference.tolist() == ids(tok, "ok")
    assert chat_alone.reference is None
    assert ps.num_truncated == 0 and "5 prompts" in ps.summary()


def test_plain_text_is_one_document_per_paragraph(tmp_path, tok):
    f = tmp_path / "d.txt"
    f.write_text("first line\nsame doc\n\n\n  \nsecond doc\n\nthird\n")
    recs = read_records(f)
    assert [r.text for r in recs] == ["first line\nsame doc", "second doc", "third"]
    assert recs[1].where.endswith("d.txt:6")
    ps = read_prompts(f, tok, 100)
    assert ps.items[0].ids.tolist() + ps.items[0].reference.tolist() == ids(tok, "first line\nsame doc")


def test_truncation_keeps_the_last_tokens_and_counts(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"text": "0123456789"},                      # 10 tokens > 6: keeps "456789", halves it
        {"prompt": "abcdefghij", "answer": "XY"},    # 12 > 6: answer kept, prompt keeps its last 4
        {"prompt": "abc", "answer": "LONGANSWER"},   # answer over 6/2 loses its end
        {"prompt": "ab"},                            # fits
    ])
    ps = read_prompts(f, tok, 6)
    text, qa, long_answer, short = ps.items
    assert text.ids.tolist() == ids(tok, "456") and text.reference.tolist() == ids(tok, "789")
    assert qa.ids.tolist() == ids(tok, "ghij") and qa.reference.tolist() == ids(tok, "XY")
    assert long_answer.reference.tolist() == ids(tok, "LON") and long_answer.answer == "LON"
    assert long_answer.ids.tolist() == ids(tok, "abc")
    assert short.ids.tolist() == ids(tok, "ab")
    assert ps.num_truncated == 3 and "3 truncated to their last 6 tokens" in ps.summary()


def test_keep_last_keeps_a_leading_bos():
    assert keep_last([1, 5, 6, 7, 8], 3, bos=1) == ([1, 7, 8], True)
    assert keep_last([2, 5, 6, 7, 8], 3, bos=1) == ([6, 7, 8], True)
    assert keep_last([1, 5], 3, bos=1) == ([1, 5], False)


def test_too_short_records_are_skipped_and_counted(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "ab"}])
    ps = read_prompts(f, tok, 100)
    assert len(ps.items) == 1 and ps.num_skipped == 1 and "1 skipped" in ps.summary()
    with pytest.raises(ConfigError, match="2 prompt tokens"):
        read_prompts(write_jsonl(tmp_path / "e.jsonl", [{"prompt": "a"}]), tok, 100)


@pytest.mark.parametrize("lines, match", [
    (['{"text": "a"}', '{"text": "b"'], r"d\.jsonl:2: not valid JSON"),
    (['{"prompt": "a", "label": 1}'], r"d\.jsonl:1: unknown key\(s\) \['label'\]"),
    (['{"text": "a", "prompt": "b"}'], "do not go together"),
    (['{"answer": "a"}'], "do not go together"),
    (['[1, 2]'], "expected a JSON object, got list"),
    (['{"text": ""}'], "non-empty string"),
    (['{"prompt": 3}'], "non-empty string"),
    (['{"messages": []}'], "non-empty list"),
    (['{"messages": [{"role": "bot", "content": "x"}]}'], r"messages\[0\]"),
    (['{"messages": [{"role": "assistant", "content": "x"}]}'], "only the assistant"),
    (["", "  "], "no records"),
])
def test_bad_jsonl_is_one_clear_error(tmp_path, lines, match):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=match):
        read_records(f)


def test_missing_empty_and_non_utf8_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_records(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="not a file"):
        read_records(tmp_path)
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(ConfigError, match="no records"):
        read_records(tmp_path / "e.txt")
    (tmp_path / "b.txt").write_bytes(b"ok\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_records(tmp_path / "b.txt")
