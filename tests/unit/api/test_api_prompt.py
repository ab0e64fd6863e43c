import pytest

from scd_serve.api.prompt import DEFAULT_CHAT_TEMPLATE, chat_prompt_ids, completion_prompts
from scd_serve.api.schemas import ChatMessage
from scd_serve.testing.fake_runtime import byte_tokenizer
from scd_serve.errors import InvalidRequest

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
            "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def test_tokenizer_chat_template_is_used_when_present():
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    ids = chat_prompt_ids([ChatMessage(role="user", content="hi")], tok)
    assert tok.decode(ids) == "[user]hi[assistant]"
    with pytest.raises(InvalidRequest) as e:  # a template refusing the input is the client's 400
        chat_prompt_ids([ChatMessage(role="system", content="x")], tok)
    assert e.value.field == "messages" and "no system role" in e.value.message


def test_default_template_without_one():
    tok = byte_tokenizer()
    ids = chat_prompt_ids([ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content=None)], tok)
    assert tok.decode(ids) == DEFAULT_CHAT_TEMPLATE.format(role="user", content="hi") + "<|assistant|>\n\n<|assistant|>\n"


def test_completion_prompt_forms():
    """OpenAI's four forms: a string, token ids, a list of strings, a list of token-id lists."""
    tok = byte_tokenizer()
    assert completion_prompts("ab", tok, 257) == [("ab", tok.encode("ab"))]
    assert completion_prompts(["ab"], tok, 257) == [("ab", tok.encode("ab"))]
    assert completion_prompts([3, 4], tok, 257) == [(None, [3, 4])]
    assert completion_prompts(["a", "b"], tok, 257) == [("a", tok.encode("a")), ("b", tok.encode("b"))]
    assert completion_prompts([[3], [4, 5]], tok, 257) == [(None, [3]), (None, [4, 5])]
    for bad in ([3, 257], [[3], [257]], ["a", ""], [[3], []]):
        with pytest.raises(InvalidRequest) as e:
            completion_prompts(bad, tok, 257)
        assert e.value.field == "prompt"
