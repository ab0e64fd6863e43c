"""The import contract: scd_serve's packages form layers, and a module imports only from its
own package or from a lower layer. Packages in one layer are independent of each other.

Read from the source (every `import` and `from ... import`, including those inside
functions), so a lazy import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "scd_serve"

# Highest first. Entry points at the top, plain settings and errors at the bottom; the
# workers (decode, prefill) sit on the API, the codec and the runtime below them.
LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("cluster", "bench", "testing", "vllm"),
    ("gateway", "pair"),
    ("decode", "prefill", "quality"),
    ("calibration",),
    ("api", "codec", "planner"),
    ("engine", "model", "transport", "control", "corpus"),
    ("config", "extras"),
    ("errors", "_proto", "__init__"),
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def unit_of(path: Path, package: Path = PACKAGE) -> str:
    """The package (or top-level module) a file belongs to: scd_serve/decode/x.py -> decode."""
    rel = path.relative_to(package).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def imported_units(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, unit) of every scd_serve import in a module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "scd_serve":
                continue
            if len(parts) > 1:
                out.append((node.lineno, parts[1]))
            else:  # from scd_serve import codec, __version__
                out += [(node.lineno, a.name if a.name in LAYER_OF else "__init__") for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "scd_serve":
                    out.append((node.lineno, parts[1] if len(parts) > 1 else "__init__"))
    return out


def violations(package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        src = unit_of(path, package)
        if src not in LAYER_OF:
            found.append(f"{path.relative_to(package)}: package {src!r} has no layer in LAYERS")
            continue
        for line, dst in imported_units(ast.parse(path.read_text(), str(path))):
            if dst == src:
                continue
            if dst not in LAYER_OF:
                found.append(f"{path.relative_to(package)}:{line} imports {dst!r}, which has no layer")
            elif LAYER_OF[dst] <= LAYER_OF[src]:
                kind = "a sibling" if LAYER_OF[dst] == LAYER_OF[src] else "a higher layer"
                found.append(f"{path.relative_to(package)}:{line}: {src} imports {dst}, {kind}")
    return found


def test_imports_go_down_the_layers():
    assert violations() == []


def test_every_package_has_a_layer():
    units = {unit_of(p) for p in PACKAGE.rglob("*.py") if "_proto" not in p.parts}
    assert units <= set(LAYER_OF), sorted(units - set(LAYER_OF))


def test_an_upward_import_is_caught(tmp_path):
    """The check can fail: a copy of two packages where the engine imports the API."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "api").mkdir()
    (tmp_path / "engine" / "loop.py").write_text("def f():\n    from scd_serve.api.routes import x\n")
    (tmp_path / "api" / "routes.py").write_text("from scd_serve.engine import loop\nimport scd_serve.errors\n")
    (tmp_path / "api" / "peer.py").write_text("from scd_serve import codec\n")  # a sibling layer
    found = violations(tmp_path)
    assert found == ["api/peer.py:1: api imports codec, a sibling",
                     "engine/loop.py:2: engine imports api, a higher layer"], found
