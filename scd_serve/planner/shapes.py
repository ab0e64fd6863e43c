"""Model shapes for projections: the shipped public configs or any HF config.json.

Only architecture numbers are read (no weights): enough to count parameters,
prefill FLOPs and the per-token size of the KV cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from scd_serve.errors import ConfigError, ModelLoadError
from scd_serve.model.spec import ModelSpec, spec_from_config

CONFIG_DIR = Path(__file__).parent / "model_configs"


@dataclass(frozen=True)
class ModelShape(ModelSpec):
    """The runtime's own spec (one shape type), named, with what a projection counts."""

    name: str = ""

    @property
    def layer_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_width * 2 + h * self.kv_width * 2  # q, o, k, v
        return attn + 3 * h * i + 2 * h  # gated MLP + two norms

    @property
    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params + emb * (1 if self.tie_word_embeddings else 2)

    def layer_flops(self, tokens: int) -> float:
        """One layer's forward over `tokens` prompt tokens: weights + causal attention."""
        return 2.0 * self.layer_params * tokens + 2.0 * tokens * tokens * self.q_width

    def prefill_flops(self, tokens: int) -> float:
        """Whole prefill, logits for the last token only."""
        return self.num_layers * self.layer_flops(tokens) + 2.0 * self.hidden_size * self.vocab_size


def available() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def config_path(name_or_path: str, field: str) -> Path:
    """A shipped name ('mistral-7b', case-insensitive), a config.json or a model directory -> its
    config.json (ConfigError naming `field` when none is found)."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        path = CONFIG_DIR / f"{name_or_path.lower()}.json"
    if not path.exists():
        raise ConfigError(f"model config {name_or_path!r} not found; give a path or one of: {', '.join(available())}",
                          field=field)
    return path


def load_shape(name_or_path: str) -> ModelShape:
    """A shipped name ('mistral-7b', case-insensitive), a config.json, or a model directory; parsed
    by the runtime's own config reader (model/spec.py), so the planner accepts what serving does."""
    path = config_path(name_or_path, "model_config")
    try:
        cfg = json.loads(path.read_text())
        spec = spec_from_config(cfg, where=str(path))
    except (ValueError, ModelLoadError) as exc:
        raise ConfigError(f"model config {path}: {exc}", field="model_config") from exc
    name = str(cfg.get("name") or cfg.get("_name_or_path") or path.parent.name or path.stem)
    return ModelShape(name=name, **{f.name: getattr(spec, f.name) for f in fields(spec)})
