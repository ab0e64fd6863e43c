"""The feature prior's vocabulary table: every token's reduced rows, computed at once.

Without it each prompt pays for its unseen tokens: their token states are a pass of their own
through the consumer's layers (codec/features.py), so at the Qwen2.5-0.5B shape a cold
1,024-token prompt's rebuild took 0.91 of the consumer's own prefill (random weights,
docs/benchmarks.md). The table holds [vocab, taps, rank] float32 rows (117 MB at vocabulary
151,936, 3 taps, rank 64: it grows with the vocabulary, not with the model). It is made on the
decode node from the consumer's own weights, never shipped in a codebook, and kept under
$SCD_CACHE_DIR, keyed by the codebook and the consumer, so that a restart reads it back.

Modes: "on" fills it before the worker serves; "off" never does; "auto" times the first chunk
and goes on only when the whole vocabulary is predicted within the budget (seconds on a GPU;
tens of minutes on a CPU at real shapes, where prompts then keep paying for their own tokens).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from scd_serve.config.decode import PRIOR_TABLE_MODES as MODES
from scd_serve.model.checkpoint import cache_dir

log = logging.getLogger("scd_serve.codec")
CHUNK = 2048  # tokens per pass: bounded activations, and a first chunk to time
MAX_AUTO_BYTES = 1 << 30  # "auto" never builds a table larger than this


def table_key(codebook: Any, consumer: Any) -> str:
    """The cache file's key: the codebook's tensors, the consumer's weights and the dtype it runs in
    (rows computed in bfloat16 differ from float32 ones)."""
    parts = (codebook.manifest.get("tensors_sha256", ""), consumer.fingerprint, str(consumer.dtype))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def cache_path(key: str) -> Path:
    return cache_dir() / f"prior-table-{key}.safetensors"


def fill_codebook(codebook: Any, consumer: Any, mode: str, budget_s: float = 60.0) -> str | None:
    """fill() for a loaded codebook's prior, keyed by table_key; None when it has no feature prior."""
    from scd_serve.codec.features import FeaturePrior

    prior = codebook.context_prior()
    if not isinstance(prior, FeaturePrior):
        return None
    return fill(prior, consumer, table_key(codebook, consumer), mode, budget_s)


def fill(prior: Any, consumer: Any, key: str, mode: str = "auto", budget_s: float = 60.0,
         clock: Callable[[], float] = time.monotonic) -> str:
    """Set `prior`'s table on the consumer's device per `mode`; -> one line saying what was done.
    key: table_key(codebook, consumer), the cache file's name."""
    if mode not in MODES:
        raise ValueError(f"prior table mode must be one of {', '.join(MODES)}, got {mode!r}")
    vocab, spec, device = consumer.spec.vocab_size, prior.spec, consumer.device
    shape = (vocab, spec.taps, spec.rank)
    size = vocab * spec.taps * spec.rank * 4
    what = f"feature prior table [{vocab} x {spec.taps} x {spec.rank}] ({size / 2**20:.0f} MiB)"
    if mode == "off":
        return f"{what}: off; each prompt computes its unseen tokens' rows"
    if mode == "auto" and size > MAX_AUTO_BYTES:
        return f"{what}: not made, over {MAX_AUTO_BYTES >> 20} MiB (--prior-table on makes it anyway)"
    path = cache_path(key)
    cached = _read(path, shape)
    if cached is not None:
        prior.set_table(cached, device)
        return f"{what}: read from {path}"
    start, parts = clock(), []
    for first in range(0, vocab, CHUNK):
        ids = torch.arange(first, min(first + CHUNK, vocab), device=device)
        parts.append(prior.token_reduced(consumer, ids, device, keep_states=False))
        if first == 0 and mode == "auto" and vocab > CHUNK:
            predicted = (clock() - start) * vocab / ids.shape[0]
            if predicted > budget_s:
                return (f"{what}: not made, predicted {predicted:.0f} s from its first {CHUNK} tokens, over the "
                        f"{budget_s:g} s budget (--prior-table on makes it anyway); each prompt computes its "
                        f"unseen tokens' rows")
    table = torch.cat(parts)  # [vocab, taps, rank]
    prior.set_table(table, device)
    saved = _write(path, table.cpu())
    return f"{what}: made in {clock() - start:.1f} s" + (f", kept in {path}" if saved else "")


def _read(path: Path, shape: tuple[int, ...]) -> torch.Tensor | None:
    try:
        table = load_file(str(path))["rows"]
    except Exception:  # noqa: BLE001 - missing, partial or foreign: made again
        return None
    return table if tuple(table.shape) == shape and table.dtype == torch.float32 else None


def _write(path: Path, table: torch.Tensor) -> bool:
    """Best effort: a read-only cache directory only costs the next start the sweep."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({"rows": table.contiguous()}, str(tmp))
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.warning("could not keep the feature prior table in %s: %s", path, exc)
        return False
