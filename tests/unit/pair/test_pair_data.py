"""The synthetic QA language: deterministic splits, extractive answers, tokenizer round trip."""

import pytest

from scd_serve.errors import InvalidRequest
from scd_serve.corpus.qa import STYLES, load_split
from scd_serve.pair.tokenizer import encode_words, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_splits_are_deterministic_and_disjoint():
    assert load_split("heldout", 5) == load_split("heldout", 5)
    assert load_split("heldout", 5, seed=1) != load_split("heldout", 5)
    held = {e["prompt"] for e in load_split("heldout", 20)}
    cal = {e["prompt"] for e in load_split("calibration", 20)}
    assert not held & cal


def test_answer_is_a_span_after_its_key_in_the_context(tokenizer):
    for ex in load_split("heldout", 10) + load_split("smoke", 10):
        words = ex["prompt"].split()
        key, answer = words[-1], ex["answer"].split()
        assert words[-2] == STYLES["expert"].ask_word and 2 <= len(answer) <= 3
        first = words.index(key)  # keys are unique in the context
        assert words[first + 1 : first + 1 + len(answer)] == answer
        assert words[first + 1 + len(answer)] == STYLES["expert"].end


def test_heldout_prompts_are_long(tokenizer):
    lengths = [len(tokenizer(e["prompt"])["input_ids"]) for e in load_split("heldout", 30)]
    assert min(lengths) >= 256 and max(lengths) <= 2048 + 8
    assert max(lengths) > 1024  # the split really covers long prompts


def test_tokenizer_is_word_level_with_bos_and_knows_every_word(tokenizer):
    text = load_split("heldout-text", 1)[0]["text"]
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.unk_token_id not in ids
    assert ids == encode_words(tokenizer, text.split())
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert train_tokenizer().get_vocab() == tokenizer.get_vocab()


def test_unknown_split_is_a_clear_error():
    with pytest.raises(InvalidRequest, match="unknown split"):
        load_split("nope", 1)


def test_copy_document_repeats_a_span_and_masks_only_the_predictable_part():
    import random

    from scd_serve.corpus.qa import make_copy_document

    doc = make_copy_document(random.Random(5), STYLES["base"], 60)
    n = sum(doc.answer_mask)
    assert len(doc.words) == len(doc.answer_mask) and 7 <= n <= 15
    repeat = doc.words[-(n + 1):]
    body = doc.words[1 : -(n + 1)]
    assert any(body[i : i + n + 1] == repeat for i in range(len(body)))
