"""Variable tracking through a real source file: the context pair's task.

Chains of assignments are inserted between the lines of a stdlib source excerpt, at the
indentation of the line they precede, spread over the whole excerpt and interleaved:

    x = 41            (a literal: 10..99)
    ...real code...
    y = 3 + x         (a constant plus an earlier name, never carrying; the name comes last)
    ...real code...
    z = 5 + y

The question at the end asks for a name's value: `assert z == ` (base style, the producer's)
or `>>> z` and a newline (expert style, the consumer's); the answer is "49", digit by digit.
The value of `z` is in no token of the text: it has to be computed at z's line from y's,
which was computed at y's line, so a model that answers writes intermediate values into the
K/V of positions far from the question. A consumer rebuilding its cache from token ids alone
cannot know them. Putting the name last lets each hop be one attention read plus one MLP
addition at the line's last token.

Names are single-token lower-case words (`bpe.single_token_words`) that do not occur in the
excerpt, Python keywords and builtins excluded, each assigned once per document; or, with
`one_name` (the recipe's default since run 10), one name per chain, reassigned line by line
(x = 41 ... x = 3 + x), so the line to read is the variable's latest. `block_document` is the
training form: one variable at a time, every one asked.
"""

from __future__ import annotations

import builtins
import keyword
import random
import re
from dataclasses import dataclass, field

from scd_serve.errors import ConfigError
from scd_serve.pair.context_corpus import SourceFile, sample_lines

MAX_ADD = 9  # the ones digit's room: the additions of a chain sum to at most this
_WORD = re.compile(r"[A-Za-z_]\w*")
_OPEN_LINE_END = (",", "(", "[", "{", "\\", ":")  # inserting after these would split a statement
CHARS_PER_TOKEN = 3.3
MAX_TRIES = 200  # excerpts drawn for one held-out prompt before the lengths are called impossible  # measured on the held-out split with the 8k tokenizer


@dataclass(frozen=True)
class Style:
    name: str
    ask: str  # formatted with the name; the prompt ends here and the answer follows

    def question(self, name: str, value: int) -> tuple[str, str]:
        """-> (text before the answer, the answer)."""
        return self.ask.format(name), str(value)


STYLES = {"base": Style("base", "assert {} == "), "expert": Style("expert", ">>> {}\n")}


@dataclass
class Chain:
    names: list[str]
    values: list[int]  # values[i] is the value of names[i]
    statements: list[str]  # without indentation; statements[i] assigns names[i]

    @property
    def depth(self) -> int:
        """Additions between the literal and the last name."""
        return len(self.names) - 1


@dataclass
class TaskDoc:
    text: str
    answers: list[tuple[int, int]] = field(default_factory=list)  # character spans of the answers in text
    asked: list[tuple[str, int, int]] = field(default_factory=list)  # (name, value, depth) per question
    # (character end of an addition line's last name, the line's new value): training-only targets
    values: list[tuple[int, int]] = field(default_factory=list)


def make_chain(rng: random.Random, names: list[str], depth: int, comment: bool = False) -> Chain:
    """A literal and `depth` additions; values stay two-digit and no addition carries (only the
    ones digit moves: 43 -> 3 + 43 = 46), so an addition is one small table a small model learns
    (run 9: with carries, additions stayed near chance after 250 grown steps)."""
    adds = [rng.randint(1, MAX_ADD // max(1, depth)) for _ in range(depth)]
    value = rng.randint(1, 9) * 10 + rng.randint(0, MAX_ADD - sum(adds))
    values, statements = [value], [f"{names[0]} = {value}"]
    for i, add in enumerate(adds, start=1):
        value += add
        values.append(value)
        statements.append(f"{names[i]} = {add} + {names[i - 1]}" + (f"  # {value}" if comment else ""))
    return Chain(names[: depth + 1], values, statements)


_RESERVED = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls"}


def free_names(pool: list[str], lines: list[str]) -> list[str]:
    used = {w for line in lines for w in _WORD.findall(line)}
    return [n for n in pool if n not in used and n not in _RESERVED]


def insertion_points(lines: list[str]) -> list[int]:
    """Indices i where a statement may go before lines[i]: an indented code line (so the name
    token is " name", as in the question) whose previous non-blank line closes a statement."""
    out, prev = [], ""
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip(" "))
        if line.strip() and indent >= 4 and not prev.endswith(_OPEN_LINE_END):
            out.append(i)
        if line.strip():
            prev = line.rstrip()
    return out


def build_doc(rng: random.Random, lines: list[str], pool: list[str], style: Style, depths: list[int],
              asked: list[int], comment_prob: float = 0.0, one_name: bool = False) -> TaskDoc | None:
    """Insert one chain per entry of `depths` into `lines`, then ask for the last name of each
    chain in `asked` (indices into depths). With `one_name` a chain assigns one name again and
    again (x = 41 ... x = 3 + x). None when the excerpt has too few places or names."""
    names = free_names(pool, lines)
    points = insertion_points(lines)
    num_statements = sum(d + 1 for d in depths)
    if len(names) < (len(depths) if one_name else num_statements) or len(points) < num_statements:
        return None
    if one_name:
        names = [n for n, d in zip(rng.sample(names, len(depths)), depths) for _ in range(d + 1)]
    else:
        names = rng.sample(names, num_statements)
    chains, start = [], 0
    for d in depths:
        chains.append(make_chain(rng, names[start:start + d + 1], d, comment=rng.random() < comment_prob))
        start += d + 1
    order = [c for c, chain in enumerate(chains) for _ in chain.statements]
    rng.shuffle(order)  # interleaved; each chain keeps its own order
    slots = dict(zip(sorted(rng.sample(points, num_statements)), order))
    next_statement = [0] * len(chains)
    out, values, offset = [], [], 0
    for i, line in enumerate(lines):
        if i in slots:
            c = slots[i]
            k = next_statement[c]
            indent = line[: len(line) - len(line.lstrip(" "))]
            statement = chains[c].statements[k]
            out.append(indent + statement)
            if k:  # an addition: its last name ends where a `  # value` comment would start
                values.append((offset + len(indent) + len(statement.partition("  # ")[0]), chains[c].values[k]))
            offset += len(out[-1]) + 1
            next_statement[c] += 1
        out.append(line)
        offset += len(line) + 1
    doc = TaskDoc("\n".join(out) + "\n", values=values)
    for c in asked:
        chain = chains[c]
        prefix, answer = style.question(chain.names[-1], chain.values[-1])
        doc.text += prefix
        doc.answers.append((len(doc.text), len(doc.text) + len(answer)))
        doc.asked.append((chain.names[-1], chain.values[-1], chain.depth))
        doc.text += answer + "\n"
    return doc


def sample_doc(rng: random.Random, files: tuple[SourceFile, ...], pool: list[str], style: Style,
               target_tokens: int, depths: list[int], asked: list[int], comment_prob: float = 0.0,
               one_name: bool = False) -> TaskDoc:
    """A document of about `target_tokens` tokens; redraws the excerpt until the chains fit."""
    num_statements = sum(d + 1 for d in depths)
    num_chars = max(200, int(target_tokens * CHARS_PER_TOKEN) - 14 * num_statements - 16 * len(asked))
    num_chars = max(num_chars, 60 * num_statements)  # about one place per 60 characters of code
    for attempt in range(1, 10_000):
        doc = build_doc(rng, sample_lines(rng, files, num_chars), pool, style, depths, asked, comment_prob, one_name)
        if doc is not None:
            return doc
        if attempt % 10 == 0:  # an excerpt this long rarely has room: allow longer ones
            num_chars = int(num_chars * 1.25)
    raise ConfigError(f"no excerpt of these files takes {num_statements} statements")


def make_examples(files: tuple[SourceFile, ...], pool: list[str], tokenizer, style: Style, n: int, seed: str,
                  lengths: tuple[int, int], depths: tuple[int, int], num_chains: tuple[int, int],
                  one_name: bool = False) -> list[dict]:
    """`n` held-out style prompts {"id", "prompt", "answer"}: one question, asked chain of depth in
    `depths`, prompt lengths (tokens, <bos> included) in `lengths`. The id says the depth."""
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        lo, hi = lengths
        for _ in range(MAX_TRIES):
            target = rng.randint(lo, hi)
            chains = [rng.randint(0, depths[1]) for _ in range(rng.randint(*num_chains) - 1)]
            chains.append(rng.randint(*depths))
            rng.shuffle(chains)
            asked = rng.choice([c for c, d in enumerate(chains) if depths[0] <= d])
            doc = sample_doc(rng, files, pool, style, target, chains, [asked], one_name=one_name)
            start, end = doc.answers[0]
            prompt, answer = doc.text[:start], doc.text[start:end]
            if lo <= len(tokenizer(prompt)["input_ids"]) <= hi:
                break
        else:
            raise ConfigError(f"no prompt of {lo}-{hi} tokens with {num_chains} chains in {MAX_TRIES} tries")
        out.append({"id": f"{seed}-{i}-depth{doc.asked[0][2]}", "prompt": prompt, "answer": answer})
    return out


def answer_token_mask(tokenizer, doc: TaskDoc) -> tuple[list[int], list[bool], dict[int, int]]:
    """-> (token ids with <bos>, True on the tokens inside an answer span, {token index of an
    addition line's last name: that line's new value})."""
    enc = tokenizer(doc.text, return_offsets_mapping=True)
    mask, ends = [], {}
    for t, (start, end) in enumerate(enc["offset_mapping"]):
        mask.append(end > start and any(a <= start and end <= b for a, b in doc.answers))
        ends[end] = t
    values = {ends[end]: value for end, value in doc.values if end in ends}
    return list(enc["input_ids"]), mask, values


GAP_TOKENS = 100  # document tokens per filler line allowed between two statements (distance grows with length)


def block_document(rng: random.Random, files: tuple[SourceFile, ...] | None, pool: list[str], style: Style,
                   length: int, max_depth: int, comment_prob: float = 0.0) -> TaskDoc:
    """Variables one after another, each tracked alone: a literal, up to `max_depth` additions to
    the same name (x = 3 + x) with filler lines between (real code from `files`, or `pass`), then
    its question and answer; blocks until about `length` tokens, every one asked. The line to
    read is always the latest one naming the variable, so a small model learns the hop (find
    it, read its value, add) before it must tell names apart. With comment_prob an addition
    shows its value (`  # 44`), scored like an answer: the value that line has to compute."""
    doc, used = TaskDoc(""), set()
    max_gap = max(3, length // GAP_TOKENS)
    while len(doc.text) < length * CHARS_PER_TOKEN:
        depth = rng.randint(0, max_depth)
        filler = _filler(rng, files, (depth + 1) * max_gap)
        name = rng.choice([n for n in free_names(pool, filler) if n not in used] or pool)
        used.add(name)
        chain = make_chain(rng, [name] * (depth + 1), depth)
        for i, statement in enumerate(chain.statements):
            for _ in range(rng.randint(0, max_gap)):
                doc.text += (filler.pop() if filler else "    pass") + "\n"
            doc.text += "    " + statement
            if i:
                doc.values.append((len(doc.text), chain.values[i]))
            if i and rng.random() < comment_prob:
                doc.text += "  # "
                doc.answers.append((len(doc.text), len(doc.text) + len(str(chain.values[i]))))
                doc.asked.append((name, chain.values[i], i))
                doc.text += str(chain.values[i])
            doc.text += "\n"
        prefix, answer = style.question(name, chain.values[-1])
        doc.text += prefix
        doc.answers.append((len(doc.text), len(doc.text) + len(answer)))
        doc.asked.append((name, chain.values[-1], depth))
        doc.text += answer + "\n"
    return doc


def _filler(rng: random.Random, files: tuple[SourceFile, ...] | None, n: int) -> list[str]:
    """Up to n lines to put between statements: indented real code, or `pass` without files."""
    if not files:
        return ["    pass"] * n
    lines = [line for line in sample_lines(rng, files, 60 * n) if line.strip()]
    return ["    " + line.strip() for line in lines[:n]][::-1]  # popped from the end: source order
