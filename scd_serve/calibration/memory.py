"""Up-front memory estimates for `calibrate` and `eval`: refuse before loading anything.

From the two models' config.json alone (no weights read): the weights in the dtype they will
be loaded in, and, for calibration with a token prior, its normal equations: a dense prior's
(codec/prior.py) [taps * (vocab + 1)]^2 float64 Gram matrix, held three times at the peak of
its solve (the counts, the centred copy and its Cholesky factor), plus X^T Y and its solution
for every layer and stream; a feature prior's (codec/features.py) alike at its width m. The estimate is compared with the memory given
(`--max-memory-gb`, default: the RAM available now; on a GPU, weights are compared with its
free memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from scd_serve.config.model import DTYPE_BYTES
from scd_serve.errors import ConfigError
from scd_serve.extras import extra

GB = 10**9  # decimal units throughout, --max-memory-gb included


def human(nbytes: float) -> str:
    for unit, size in (("TB", 10**12), ("GB", GB), ("MB", 10**6)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes / 1000:.1f} kB"


@dataclass
class Estimate:
    """Bytes per item (name -> bytes), split by where they live."""

    host: dict[str, int] = field(default_factory=dict)  # CPU RAM (the prior always)
    device: dict[str, int] = field(default_factory=dict)  # where the models go (the host for cpu)

    def describe(self, items: dict[str, int]) -> str:
        return "; ".join(f"{name} {human(b)}" for name, b in items.items())


def read_spec(path: str | Path):
    """The ModelSpec of a model directory from its config.json alone (ModelLoadError if bad)."""
    from scd_serve.model.loader import read_config, resolve
    from scd_serve.model.spec import spec_from_config

    root = resolve(path)
    return spec_from_config(read_config(root), where=str(root / "config.json"))


def weight_bytes(spec, dtype: str) -> int:
    from scd_serve.model.weights import expected_shapes

    return sum(math.prod(s) for s in expected_shapes(spec).values()) * DTYPE_BYTES[dtype]


def prior_bytes(spec, taps: int) -> tuple[int, int]:
    """(one Gram matrix, peak of the whole fit) in bytes for a dense token prior of `taps`."""
    if taps <= 0:
        return 0, 0
    width = taps * (spec.vocab_size + 1)
    gram = width * width * 8
    targets = spec.num_layers * (2 * spec.kv_width + spec.hidden_size)  # k, v and h per layer
    return gram, 3 * gram + 3 * width * targets * 8


def feature_prior_bytes(spec, cfg) -> int:
    """Peak of a feature prior's fit (codec/features.py): [m, m] matrices six times (the Gram
    and its eigenvectors, c c^T and its scaled copy, eigh's output and workspace), X^T Y of every
    target twice (the sums while they move into the eigenbasis), the sampled rows' features."""
    states = cfg.state_columns(spec.num_layers, spec.kv_width)
    m = cfg.prior_taps * (spec.hidden_size + states + cfg.prior_width + cfg.prior_frequent)
    targets = spec.num_layers * (2 * spec.kv_width + spec.hidden_size)
    return 6 * m * m * 8 + 2 * m * targets * 8 + cfg.max_rows * m * 4


def estimate(producer: str | Path, consumer: str | Path, dtype: str, cfg=None) -> Estimate:
    """Weights of both models in `dtype`, and the token prior's fit of a CalibrateConfig.

    One directory given as both fits no prior (calibrate fits none for one model); two
    directories are assumed to hold two models (a conservative estimate)."""
    spec_a, spec_b = read_spec(producer), read_spec(consumer)
    est = Estimate()
    est.device[f"producer weights ({dtype})"] = weight_bytes(spec_a, dtype)
    est.device[f"consumer weights ({dtype})"] = weight_bytes(spec_b, dtype)
    same = Path(producer).resolve() == Path(consumer).resolve()
    if cfg is None or not cfg.uses_prior or same:
        return est
    if cfg.prior == "dense":
        gram, peak = prior_bytes(spec_b, cfg.prior_taps)
        width = cfg.prior_taps * (spec_b.vocab_size + 1)
        est.host[f"dense token prior (--prior-taps {cfg.prior_taps}, vocab {spec_b.vocab_size:,}: a [{width:,} x "
                 f"{width:,}] float64 Gram matrix of {human(gram)}, 3 copies while it is solved)"] = peak
    else:
        est.host[f"feature prior fit (--prior-width {cfg.prior_width})"] = feature_prior_bytes(spec_b, cfg)
    return est


def available_bytes(device: str) -> tuple[int, int]:
    """(host RAM available now, free memory where the models go)."""
    with extra("calibrate", "the memory check of calibrate and eval"):
        import psutil

    host = int(psutil.virtual_memory().available)
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return host, int(free)
    return host, host


def check_fits(est: Estimate, device: str, max_memory_gb: float | None, command: str) -> None:
    """ConfigError with the estimate and what to do when it will not fit; nothing is loaded."""
    from scd_serve.model.loader import check_device

    check_device(device, torch.float32)  # a bad device is one clear error here, not a traceback
    if max_memory_gb is not None and max_memory_gb <= 0:
        raise ConfigError(f"--max-memory-gb must be > 0, got {max_memory_gb}", field="max_memory_gb")
    host, dev = available_bytes(device)
    given = "the --max-memory-gb given" if max_memory_gb is not None else "the RAM available now"
    if max_memory_gb is not None:
        host = dev = int(max_memory_gb * GB)
    on_host = torch.device(device).type == "cpu"
    host_need = sum(est.host.values()) + (sum(est.device.values()) if on_host else 0)
    dev_need = sum(est.device.values())
    if sum(est.host.values()) and host_need > host:
        items = est.host | (est.device if on_host else {})
        raise ConfigError(
            f"{command} would need about {human(host_need)}, more than {given} ({human(host)}): "
            f"{est.describe(items)}. A dense token prior grows with vocab^2: use --prior features (the default), "
            "a smaller --prior-width, --prior none (codes only), or a machine with more memory", field="prior")
    if dev_need > dev:
        where = "" if on_host or max_memory_gb is not None else f" free on {device}"
        raise ConfigError(
            f"{command} would need about {human(dev_need)} for the models, more than {given} "
            f"({human(dev)}{where}): {est.describe(est.device)}. Use a smaller --dtype (bfloat16 halves "
            "float32), another --device, or a machine with more memory", field="max_memory_gb")
