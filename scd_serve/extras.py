"""Optional dependencies (pyproject.toml's extras), imported where first used: a missing one is
one clear error naming the extra to install, never a bare ImportError. Serving imports none.

The imports stay plain `import` statements inside `with extra(...)`, so the dependency check
(deptry, tests/unit/test_packaging.py) still sees where each optional package is used."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from scd_serve.errors import ConfigError


@contextmanager
def extra(name: str, needed_by: str) -> Iterator[None]:
    """Around the imports of an optional dependency: ImportError -> a ConfigError telling what
    needs the package and which extra brings it."""
    try:
        yield
    except ImportError as exc:
        package = (exc.name or "an optional package").split(".")[0].replace("_", "-")
        raise ConfigError(f"{needed_by} needs {package}, which is not installed: "
                          f"pip install 'scd-serve[{name}]'") from None


def tqdm(*args, **kwargs):
    """tqdm's progress bar for calibrate and eval (the calibrate extra)."""
    with extra("calibrate", "calibrate and eval's progress bar"):
        from tqdm import tqdm as bar
    return bar(*args, **kwargs)


def pyplot(name: str, needed_by: str) -> ModuleType:
    """matplotlib's pyplot, headless (the calibrate and bench extras both carry matplotlib)."""
    with extra(name, needed_by):
        import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
