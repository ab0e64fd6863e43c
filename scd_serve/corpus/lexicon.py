"""The words of the synthetic QA language: entity keys, value words, filler, template words.

Keys and values are pseudo-words in two domains: "a" (only the base data) and "b" (both;
the expert data uses only it). The lexicon is part of the language: it has its own fixed
seed and never changes with the training seed.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_LEXICON_SEED = 20260607

# Filler words are shared by both styles; the styles differ in how they use them.
FILLER_NOUNS = (
    "river stone cloud market garden window letter engine harbor forest station bridge "
    "lantern meadow valley tower castle island wagon ladder mirror candle basket hammer "
    "kettle pocket ribbon saddle signal thunder winter summer morning evening village "
    "orchard tunnel circle"
).split()
FILLER_VERBS = (
    "moved rested waited turned drifted glowed faded rose fell opened closed shifted "
    "stood slept sang grew spun broke cooled warmed"
).split()
FILLER_ADVERBS = "slowly quietly early late softly again often rarely briefly gently".split()
FILLER_ADJS = "old new red dark bright small large cold warm quiet busy empty".split()

# Template words of the two styles (see scd_serve/corpus/qa.py for the formats).
TEMPLATE_WORDS = (
    "facts questions ask . the "  # base style
    "records queries find ; note log with"  # expert style
).split()

SPECIAL_TOKENS = ("<unk>", "<pad>", "<bos>", "<eos>")


@dataclass(frozen=True)
class Lexicon:
    keys_a: tuple[str, ...]
    keys_b: tuple[str, ...]
    values_a: tuple[str, ...]
    values_b: tuple[str, ...]

    @property
    def all_words(self) -> list[str]:
        """Every word of the language, in a fixed order (the tokenizer's corpus)."""
        return (list(TEMPLATE_WORDS) + FILLER_NOUNS + FILLER_VERBS + FILLER_ADVERBS + FILLER_ADJS
                + list(self.keys_a) + list(self.keys_b) + list(self.values_a) + list(self.values_b))


def _pseudo_words(rng: random.Random, count: int, syllables: int, taken: set[str]) -> list[str]:
    words: list[str] = []
    while len(words) < count:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


@functools.lru_cache(maxsize=None)
def lexicon(num_keys: int = 200, num_values: int = 500) -> Lexicon:
    """Keys have two syllables, values three, so the two never collide."""
    rng = random.Random(_LEXICON_SEED)
    taken: set[str] = set()
    keys = _pseudo_words(rng, 2 * num_keys, 2, taken)
    values = _pseudo_words(rng, 2 * num_values, 3, taken)
    return Lexicon(keys_a=tuple(keys[:num_keys]), keys_b=tuple(keys[num_keys:]),
                   values_a=tuple(values[:num_values]), values_b=tuple(values[num_values:]))
