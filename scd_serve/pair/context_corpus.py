"""The context pair's documents: the Python standard library's own source, split by module.

Real text nobody on this project wrote: every `.py` file of the running interpreter's stdlib
(tests, vendored encodings tables and the generated pydoc topics excluded). A "module" is the
top-level name (`email/mime/text.py` belongs to `email`), and a whole module goes to one split,
so held-out text never shares a file or a package with the training text. Modules are dealt in
a seeded order to the split that is furthest below its share of characters, which keeps the
shares close to SHARES whatever the package sizes.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from scd_serve.errors import ConfigError

# split -> share of the corpus characters
SHARES = {"base": 0.5, "expert": 0.3, "calibration": 0.1, "heldout": 0.1}
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings",
                 "pydoc_data"}


@dataclass(frozen=True)
class SourceFile:
    module: str  # top-level module or package name
    path: str  # relative to the stdlib root
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=4)
def _all_files(root: str) -> tuple[SourceFile, ...]:
    out = []
    for here, dirs, names in os.walk(root):  # pruned: the stdlib may hold a big site-packages
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith("config-"))
        for name in sorted(n for n in names if n.endswith(".py")):
            rel = Path(here, name).relative_to(root)
            text = Path(here, name).read_text(encoding="utf-8", errors="replace")
            if text.strip():
                out.append(SourceFile(rel.parts[0].removesuffix(".py"), str(rel), text))
    out.sort(key=lambda f: f.path)
    if not out:
        raise ConfigError(f"no Python sources under {root}: the context pair needs the stdlib's .py files")
    return tuple(out)


def assign_modules(sizes: dict[str, int], seed: int) -> dict[str, str]:
    """module -> split: modules in a seeded order, each to the split furthest below its share."""
    return deal_in_order(sorted(sizes, key=lambda m: hashlib.sha256(f"{seed}:{m}".encode()).hexdigest()), sizes, SHARES)


def deal_in_order(order: list[str], sizes: dict[str, int], shares: dict[str, float]) -> dict[str, str]:
    """unit -> split: each unit, in the order given, to the split furthest below its share of size."""
    have = dict.fromkeys(shares, 0)
    out = {}
    for unit in order:
        total = sum(have.values()) + sizes[unit]
        split = max(shares, key=lambda s: shares[s] * total - have[s])
        out[unit] = split
        have[split] += sizes[unit]
    return out


@functools.lru_cache(maxsize=8)
def load_splits(seed: int = 0, root: str | None = None) -> dict[str, tuple[SourceFile, ...]]:
    """split name -> its files, the same on every machine with the same stdlib and seed."""
    files = _all_files(root or str(stdlib_root()))
    sizes: dict[str, int] = {}
    for f in files:
        sizes[f.module] = sizes.get(f.module, 0) + len(f.text)
    where = assign_modules(sizes, seed)
    return {s: tuple(f for f in files if where[f.module] == s) for s in SHARES}


def sample_lines(rng: random.Random, files: tuple[SourceFile, ...], num_chars: int) -> list[str]:
    """About `num_chars` characters of consecutive lines from one file (uniform over lines:
    a file is drawn by its size). A short file gives what it has; callers check the length."""
    weights = [len(f.text) for f in files]
    f = rng.choices(files, weights=weights)[0]
    lines = f.text.splitlines()
    return line_run(lines, rng.randrange(len(lines)), num_chars)


def line_run(lines: list[str], start: int, num_chars: int) -> list[str]:
    """Consecutive lines from `start` (right-stripped) until about `num_chars` characters."""
    out, size = [], 0
    for line in lines[start:]:
        out.append(line.rstrip())
        size += len(line) + 1
        if size >= num_chars:
            break
    return out


def training_text(splits: dict[str, tuple[SourceFile, ...]], names: tuple[str, ...]) -> list[str]:
    """Whole files of the named splits (the tokenizer's corpus)."""
    return [f.text for name in names for f in splits[name]]
