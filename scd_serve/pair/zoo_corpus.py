"""The pair zoo's documents: real text nobody on this project wrote, in three domains.

- `stdlib`: the running interpreter's standard library source (context_corpus.py), a unit per
  top-level module;
- `code`: the source of third-party packages installed next to scd-serve (CODE_PACKAGES, those
  present), a unit per package subdirectory or top-level module;
- `docs`: prose: the packages' docstrings (one document per module, as an API page reads),
  the stdlib's own documentation topics (pydoc_data) and the packages' descriptions (METADATA).

Each domain's units are dealt to train / calibration / heldout by a seeded order, so the
fine-tune, calibration and held-out texts never share a document or a unit: held-out quality
is measured on other documents than calibration's, as a user's own held-out split would be.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from scd_serve.errors import ConfigError
from scd_serve.pair.context_corpus import _all_files, deal_in_order, line_run, stdlib_root

SHARES = {"train": 0.8, "calibration": 0.1, "heldout": 0.1}
# installed with scd-serve's own dependencies (the test extra), so every machine with the same
# constraints.txt holds the same files; a missing one is skipped and the report lists those used
CODE_PACKAGES = ("transformers", "torch", "numpy", "matplotlib", "openai", "pygments", "networkx", "huggingface_hub",
                 "hypothesis", "pydantic", "_pytest", "rich", "fastapi", "grpc", "jinja2", "click", "anyio", "urllib3",
                 "packaging", "schemathesis", "sympy", "fsspec", "starlette", "httpx")
SKIP_DIRS = {"tests", "test", "testing", "__pycache__", "_vendor", "vendored"}


@dataclass(frozen=True)
class Document:
    unit: str  # what a split keeps whole (a module, a package subdirectory, a docs topic)
    name: str
    text: str


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _seeded(items, seed: int, salt: str) -> list:
    return sorted(items, key=lambda x: hashlib.sha256(f"{salt}:{seed}:{x}".encode()).hexdigest())


def _package_files(root: Path, package: str) -> list[tuple[str, Path]]:
    """(unit, path) of a package's .py files; unit = the package and its first subdirectory."""
    out = []
    base = root / package
    if (root / f"{package}.py").is_file():
        return [(package, root / f"{package}.py")]
    for here, dirs, names in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(n for n in names if n.endswith(".py")):
            rel = Path(here, name).relative_to(root)
            unit = "/".join(rel.parts[:2]) if len(rel.parts) > 2 else rel.parts[0] + "/" + rel.stem
            out.append((unit, Path(here, name)))
    return out


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _capped(files: list[tuple[str, Path]], cap: int, seed: int, salt: str) -> list[tuple[str, Path, str]]:
    """Whole units in a seeded order until `cap` characters (a huge package gives a sample, not all)."""
    by_unit: dict[str, list[Path]] = {}
    for unit, path in files:
        by_unit.setdefault(unit, []).append(path)
    out, size = [], 0
    for unit in _seeded(by_unit, seed, salt):
        for path in by_unit[unit]:
            text = _read(path)
            if text.strip():
                out.append((unit, path, text))
                size += len(text)
        if size >= cap:
            break
    return out


def docstring_page(module: str, text: str) -> str:
    """A module's docstrings as an API page: the module's, then each class and function's."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ""
    parts = []
    if doc := ast.get_docstring(tree):
        parts.append(f"{module}\n\n{doc}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (doc := ast.get_docstring(node)):
            if len(doc) >= 40:
                parts.append(f"{module}.{node.name}\n\n{doc}")
    return "\n\n\n".join(parts)


def _metadata_description(path: Path) -> str:
    text = _read(path)
    head, _, body = text.partition("\n\n")
    return body if len(body) > 200 else ""


@functools.lru_cache(maxsize=8)
def domain_documents(domain: str, seed: int, package_chars: int) -> tuple[Document, ...]:
    if domain == "stdlib":
        return tuple(Document(f.module, f.path, f.text) for f in _all_files(str(stdlib_root())))
    root = site_packages()
    present = [p for p in CODE_PACKAGES if (root / p).is_dir() or (root / f"{p}.py").is_file()]
    if not present:
        raise ConfigError(f"none of the zoo's packages ({', '.join(CODE_PACKAGES)}) is installed under {root}")
    docs: list[Document] = []
    for package in present:
        for unit, path, text in _capped(_package_files(root, package), package_chars, seed, f"{domain}:{package}"):
            name = str(path.relative_to(root))
            if domain == "code":
                docs.append(Document(unit, name, text))
            elif page := docstring_page(name.removesuffix(".py").replace("/", "."), text):
                docs.append(Document(unit, name, page))
    if domain == "docs":
        docs += _topics() + [Document(f"meta/{p.parent.name}", str(p.relative_to(root)), d)
                             for p in sorted(root.glob("*.dist-info/METADATA")) if (d := _metadata_description(p))]
    if domain not in ("code", "docs"):
        raise ConfigError(f"unknown zoo domain {domain!r}")
    return tuple(docs)


def _topics() -> list[Document]:
    """The stdlib's documentation topics (the text `help('topic')` shows), one document each."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a stripped interpreter
        return []
    return [Document(f"pydoc/{name}", f"pydoc:{name}", text) for name, text in sorted(topics.items()) if len(text) > 200]


def deal(sizes: dict[str, int], seed: int, shares: dict[str, float] = SHARES) -> dict[str, str]:
    """unit -> split: units in a seeded order, each to the split furthest below its share."""
    return deal_in_order(list(_seeded(sizes, seed, "deal")), sizes, shares)


@functools.lru_cache(maxsize=8)
def splits(domain: str, seed: int, package_chars: int) -> dict[str, tuple[Document, ...]]:
    docs = domain_documents(domain, seed, package_chars)
    sizes: dict[str, int] = {}
    for d in docs:
        sizes[d.unit] = sizes.get(d.unit, 0) + len(d.text)
    where = deal(sizes, seed)
    return {s: tuple(d for d in docs if where[d.unit] == s) for s in SHARES}


def excerpt(rng: random.Random, docs: tuple[Document, ...], num_chars: int) -> tuple[Document, str]:
    """About `num_chars` characters of consecutive lines of one document (drawn by its size)."""
    doc = rng.choices(docs, weights=[len(d.text) for d in docs])[0]
    lines = doc.text.splitlines()
    return doc, "\n".join(line_run(lines, rng.randrange(max(1, len(lines))), num_chars))


INSTRUCTION = "### Instruction:\nWrite the docstring of this function.\n\n```python\n{code}\n```\n\n### Response:\n"


def instructions(docs: tuple[Document, ...], max_code_chars: int = 1500) -> list[tuple[str, str, str]]:
    """(prompt, answer, document name) from the documents' functions that have a docstring: the
    function without it in an instruction template, and its docstring's first paragraph as the answer."""
    out = []
    for d in docs:
        try:
            tree = ast.parse(d.text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not (doc := ast.get_docstring(node)):
                continue
            answer = doc.split("\n\n")[0].strip()
            body = node.body[1:]
            if len(answer) < 20 or not body:
                continue
            bare = copy.copy(node)  # the function without its docstring and decorators
            bare.body, bare.decorator_list = body, []
            try:
                code = ast.unparse(bare)
            except (ValueError, TypeError, AttributeError):
                continue
            if len(code) <= max_code_chars:
                out.append((INSTRUCTION.format(code=code), answer, d.name))
    return out
