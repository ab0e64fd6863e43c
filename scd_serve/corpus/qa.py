"""Deterministic synthetic extractive QA: documents of facts and distractors, then questions.

Two styles of one language (same words, different format and domain):

  base   (producer):  <bos> facts K V V . the river moved slowly . ... questions ask K V V .
  expert (consumer):  <bos> records K V V ; log tower dark harbor ; ... queries find K V V ;

A fact binds a key to a 2-3 word value, which the question's answer copies from the context;
the value follows its key directly (the induction pattern small transformers learn fastest).
Within a document keys and value words never repeat, so the answer is unambiguous. All is
seeded: `load_split(name, n)` gives the same examples on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from scd_serve.errors import InvalidRequest
from scd_serve.corpus import lexicon as lx


@dataclass(frozen=True)
class Style:
    name: str
    header: str
    q_header: str
    ask_word: str  # starts a question
    end: str  # ends a fact, a filler sentence and an answer
    domains: tuple[str, ...]  # which lexicon domains keys and values come from


STYLES = {
    "base": Style("base", "facts", "questions", "ask", ".", ("a", "b")),
    "expert": Style("expert", "records", "queries", "find", ";", ("b",)),
}


@dataclass
class Document:
    words: list[str]  # without <bos>
    answer_mask: list[bool]  # True on answer value words and the end word after them


def _filler(rng: random.Random, style: Style) -> list[str]:
    n, v = rng.choice(lx.FILLER_NOUNS), rng.choice(lx.FILLER_VERBS)
    a, j = rng.choice(lx.FILLER_ADVERBS), rng.choice(lx.FILLER_ADJS)
    if style.name == "base":
        body = ["the", n, v, a] if rng.random() < 0.5 else ["the", j, n, v]
    else:
        body = ["log", n, j, rng.choice(lx.FILLER_NOUNS)] if rng.random() < 0.5 else ["note", n, "with", j]
    return body + [style.end]


def _pools(style: Style) -> tuple[list[str], list[str]]:
    lex = lx.lexicon()
    keys = [k for d in style.domains for k in getattr(lex, f"keys_{d}")]
    values = [v for d in style.domains for v in getattr(lex, f"values_{d}")]
    return keys, values


def make_document(rng: random.Random, style: Style, target_len: int, num_questions: int,
                  fact_prob: float = 0.4) -> tuple[Document, list[tuple[str, list[str]]]]:
    """A document of about `target_len` words ending with `num_questions` answered questions;
    -> (the document, its facts as (key, value words) in context order)."""
    keys, values = _pools(style)
    key_iter = iter(rng.sample(keys, len(keys)))
    value_iter = iter(rng.sample(values, len(values)))
    question_len = 1 + 5 * num_questions  # ask K V V (V) end: 5.5 words each
    words = [style.header]
    facts: list[tuple[str, list[str]]] = []
    num_keys, num_values = len(keys), len(values)
    while len(words) < target_len - question_len or len(facts) < num_questions:
        room = len(facts) < num_keys and 3 * (len(facts) + 1) <= num_values
        if room and rng.random() < fact_prob:
            key = next(key_iter)
            value = [next(value_iter) for _ in range(rng.choice((2, 3)))]
            facts.append((key, value))
            words += [key, *value, style.end]
        else:
            words += _filler(rng, style)
    mask = [False] * (len(words) + 1)
    words.append(style.q_header)
    for key, value in rng.sample(facts, num_questions):
        words += [style.ask_word, key, *value, style.end]
        mask += [False] * 2 + [True] * (len(value) + 1)
    return Document(words, mask), facts


def make_copy_document(rng: random.Random, style: Style, target_len: int, vocab_size: int = 0) -> Document:
    """Random words with a span of them repeated later: a tiny model finds the induction circuit
    on long repeated spans far sooner than on 2-3 word answers, and QA then reuses it.
    vocab_size > 0 draws from that many words (keys and values alternately): a shorter plateau."""
    keys, values = _pools(style)
    if vocab_size:
        vocab = ([w for pair in zip(keys, values) for w in pair] + values[len(keys):])[:vocab_size]
    else:
        vocab = keys + values + lx.FILLER_NOUNS + lx.FILLER_VERBS
    span = rng.randint(8, 16)
    body = [rng.choice(vocab) for _ in range(max(span + 2, target_len - span - 1))]
    start = rng.randint(0, len(body) - span)
    cut = rng.randint(start + span, len(body))  # the repeat starts after the original span
    words = [style.header] + body[:cut] + body[start : start + span]
    mask = [False] * (1 + cut + 1) + [True] * (span - 1)
    return Document(words, mask)


# split name -> (style, (min, max) prompt length in tokens including <bos>, questions per text)
SPLITS = {
    "train-base": ("base", (128, 512), 1),
    "train-expert": ("expert", (256, 1024), 1),
    "calibration": ("expert", (256, 1024), 1),
    "heldout": ("expert", (256, 2048), 1),
    "heldout-text": ("expert", (256, 1024), 6),
    # seconds-sized stand-ins for tests and smoke runs
    "smoke": ("expert", (40, 80), 1),
    "smoke-text": ("expert", (40, 80), 3),
}


def load_split(name: str, n: int, seed: int = 0) -> list[dict]:
    """`n` examples of a split, the same on every machine for the same (name, seed). QA splits:
    {"id", "prompt" (ending "ask K" or "find K"), "answer" (the value words)}; "*-text" splits:
    {"id", "text"}, a whole document with several answered questions, for perplexity."""
    if name not in SPLITS:
        raise InvalidRequest(f"unknown split {name!r}; choose one of {sorted(SPLITS)}", field="split")
    style_name, (lo, hi), num_q = SPLITS[name]
    style = STYLES[style_name]
    out = []
    for i in range(n):
        rng = random.Random(f"{name}:{seed}:{i}")
        target = rng.randint(lo, hi) - 1  # -1 for <bos>
        if name.endswith("-text"):
            doc, _ = make_document(rng, style, target, num_q)
            out.append({"id": f"{name}-{i}", "text": " ".join(doc.words)})
            continue
        doc, _ = make_document(rng, style, target + 4, 1)  # +4: body >= target - 2, then 3 words
        answer_start = doc.answer_mask.index(True)
        out.append({"id": f"{name}-{i}", "prompt": " ".join(doc.words[:answer_start]),
                    "answer": " ".join(doc.words[answer_start:-1])})
    return out
