"""`--expert NAME=DIR[:CODEBOOK]`: a further consumer (a fine-tuned expert: a model or a LoRA
adapter directory) of one producer, as `scd-serve up` serves it and `bench chat` chains it."""

from __future__ import annotations

from pathlib import Path

from scd_serve.errors import ConfigError


def parse_experts(specs: list[str], taken: set[str]) -> list[tuple[str, str, str]]:
    """--expert NAME=DIR[:CODEBOOK] -> (name, model directory, codebook or ""), checked."""
    out = []
    for spec in specs:
        name, eq, rest = spec.partition("=")
        model, _, codebook = rest.partition(":")
        if not eq or not name or not model:
            raise ConfigError(f"--expert {spec!r}: expected NAME=DIR or NAME=DIR:CODEBOOK", field="expert")
        if name in taken:
            raise ConfigError(f"--expert {spec!r}: the model name {name!r} is served already", field="expert")
        if not any((Path(model) / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise ConfigError(f"--expert {spec!r}: {model} is neither a model nor a LoRA adapter directory",
                              field="expert")
        if codebook and not (Path(codebook) / "manifest.json").is_file():
            raise ConfigError(f"--expert {spec!r}: {codebook} is not a codebook directory", field="expert")
        taken.add(name)
        out.append((name, model, codebook))
    return out
