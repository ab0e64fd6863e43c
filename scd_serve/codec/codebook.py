"""Codebook: the offline-fitted SCD tensors (safetensors) plus a JSON manifest.

Layout of a codebook directory:
  manifest.json          codec version, both models' specs and fingerprints, plans, stats,
                         sha256 and size of the tensor file
  codebook.safetensors   per layer and stream s in {k, v, h, r}:
                         layers.L.s.mu_a [dA], layers.L.s.enc [dA, R]      (producer side)
                         layers.L.s.mu_b [dB], layers.L.s.dec.rR [R, dB]   (consumer side, k and v)
                         layers.L.s.g.rR.<param>          (consumer aligner of h: H_in, r: residual)
                         layers.L.s.prior [rows, dB], .prior_bias [dB]
                                                 (consumer token prior, optional: rows = the
                                                 feature prior's rank, or taps * (vocab + 1))
                         prior.basis [m, rank], prior.mean [m]    (a feature prior's basis)
Loading checks the version, the file's integrity, every tensor's shape against the plans
and, when models are given, their fingerprints and shapes; each failure is a CodebookError
that names what differs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from scd_serve.codec.base import ATTN_INPUTS, OWN_INPUTS
from scd_serve.codec.lowrank import Aligner
from scd_serve.codec.refiner import Refiner
from scd_serve.codec.plan import Plan
from scd_serve.codec.codec_spec import CodecSpec, spec_of
from scd_serve.errors import CodebookError, ConfigError

CODEBOOK_VERSION = "scd-codebook/1"
MANIFEST, TENSORS = "manifest.json", "codebook.safetensors"
SPEC_FIELDS = ("num_layers", "hidden_size", "num_kv_heads", "head_dim", "rope_theta")


def codebook_arg(path: str) -> str | None:
    """A worker's --codebook: the directory if it exists, else None (codebook-free methods only)."""
    return path if path and Path(path).is_dir() else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Codebook:
    def __init__(self, manifest: dict[str, Any], tensors: dict[str, torch.Tensor]):
        self.manifest = manifest
        self.tensors = tensors

    # ---- views ---------------------------------------------------------------------------
    def side_spec(self, side: str) -> CodecSpec:
        d = self.manifest[side]
        return CodecSpec(*(d[f] for f in SPEC_FIELDS), fingerprint=d.get("fingerprint"))

    def plan(self, name: str) -> Plan:
        plans = self.manifest.get("plans", {})
        if name not in plans:
            raise CodebookError(f"codebook has no plan for method '{name}' (it has: {', '.join(plans) or 'none'})")
        return Plan.from_json(plans[name])

    @property
    def replay_tokens(self) -> int:
        """Prompt tokens the consumer recomputes itself before the handoff's end (codec/base.py),
        chosen by calibration for the scd plan; 0 in codebooks from before it."""
        return self._token_count("replay_tokens")

    @property
    def head_tokens(self) -> int:
        """The prompt's first tokens the consumer computes itself (codec/rebuild.py), chosen by
        calibration for the scd plan; 0 in codebooks from before it."""
        return self._token_count("head_tokens")

    def _token_count(self, key: str) -> int:
        value = self.manifest.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CodebookError(f"codebook manifest: {key} must be a non-negative integer, got {value!r}")
        return value

    @property
    def prior(self) -> dict[str, Any] | None:
        """The prior's manifest entry when the decoders add token priors, else None."""
        return self.manifest.get("prior")

    def context_prior(self) -> Any:
        """The prior object (features.FeaturePrior or prior.DensePrior), or None without one."""
        if self.prior is None:
            return None
        if not hasattr(self, "_context_prior"):
            from scd_serve.codec.features import FeaturePrior
            from scd_serve.codec.prior import DensePrior

            kinds = {"features": FeaturePrior, "dense": DensePrior}
            kind = self.prior.get("kind", "dense")  # codebooks before feature priors had dense ones
            if kind not in kinds:
                raise CodebookError(f"codebook prior kind {kind!r} is unknown (this build reads {', '.join(kinds)})")
            self._context_prior = kinds[kind].from_codebook(self.prior, self.tensors)
        return self._context_prior

    def prior_tensors(self, layer: int, stream: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        name = f"layers.{layer}.{stream}.prior"
        return (self.tensors[name], self.tensor(f"{name}_bias")) if name in self.tensors else None

    @property
    def droidspeak_layers(self) -> list[int] | None:
        return self.manifest.get("droidspeak_layers")

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CodebookError(f"codebook tensor '{name}' is missing")
        return self.tensors[name]

    def refiner(self, layer: int, s: str, rank: int = 0) -> Refiner | None:
        """Reuse stream s's refiner (codec/refiner.py): the one distillation tuned for a rank-`rank`
        code (`ref_r{rank}.*`) where there is one, else the stream's, or None where it has neither."""
        for prefix in ([f"layers.{layer}.{s}.ref_r{rank}."] if rank else []) + [f"layers.{layer}.{s}.ref."]:
            found = {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}
            if found:
                break
        else:
            return None
        prior = self.context_prior()
        if getattr(prior, "kind", None) != "features":
            raise CodebookError(f"codebook tensor {prefix}* needs a feature prior, and the manifest has none")
        return Refiner.from_tensors(found, found["up.weight"].shape[1] - prior.rows())

    def aligner(self, layer: int, s: str, rank: int) -> Aligner:
        """The consumer's map g of stream s (h: H_in, r: a run's residual) at `rank`."""
        prefix = f"layers.{layer}.{s}.g.r{rank}."
        return Aligner.from_tensors({k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)})

    # ---- checks --------------------------------------------------------------------------
    def check_models(self, producer: Any = None, consumer: Any = None) -> None:
        """Refuse models other than the calibrated ones, naming the differing fields."""
        for side, model in (("producer", producer), ("consumer", consumer)):
            if model is None:
                continue
            want, got = self.side_spec(side), spec_of(model)
            if want.fingerprint and got.fingerprint and want.fingerprint != got.fingerprint:
                raise CodebookError(f"codebook was calibrated for {side} {want.fingerprint}, "
                                    f"but the {side} is {got.fingerprint}")
            diffs = [f"{f} {getattr(want, f)} != {getattr(got, f)}" for f in SPEC_FIELDS
                     if getattr(want, f) != getattr(got, f)]
            if diffs:
                raise CodebookError(f"codebook {side} shape differs from the {side} model: {'; '.join(diffs)}")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes every plan's tensors must have (ranks may be stored wider for nesting)."""
        a, b = self.side_spec("producer"), self.side_spec("consumer")
        hidden = (a.hidden_size, b.hidden_size)
        width = {"k": (a.kv_width, b.kv_width), "v": (a.kv_width, b.kv_width), "h": hidden, "r": hidden}
        inputs = self.code_inputs()
        shapes: dict[str, tuple[int, ...]] = {}
        for name in self.manifest.get("plans", {}):
            plan = self.plan(name)
            if len(plan.layers) != a.num_layers:
                raise CodebookError(f"plan '{name}' has {len(plan.layers)} layers, the models have {a.num_layers}")
            for i, lp in enumerate(plan.layers):
                for s, r in lp.decoded:
                    da, db = width[inputs[s]][0], width[s][1]
                    p = f"layers.{i}.{s}"
                    if r:
                        shapes[f"{p}.mu_a"] = (da,)
                    if s in "hr":  # the aligner carries its own bias
                        shapes[f"{p}.g.r{r}.linear.weight"] = (db, r)
                    else:
                        shapes[f"{p}.mu_b"] = (db,)
                        if r:  # rank 0: the mean and prior alone
                            shapes[f"{p}.dec.r{r}"] = (r, db)
                        for ref in (f"{p}.ref", f"{p}.ref_r{r}"):
                            if f"{ref}.down.weight" in self.tensors:
                                shapes[f"{ref}.down.weight"] = (db, self.tensors[f"{ref}.down.weight"].shape[1])
                    if self.prior and f"{p}.prior" in self.tensors:
                        rows = self.context_prior().rows()
                        shapes[f"{p}.prior"], shapes[f"{p}.prior_bias"] = (rows, db), (db,)
        return shapes

    def code_inputs(self) -> dict[str, str]:
        """stream -> the stream whose producer state its code is computed from (the manifest's
        "code_inputs"; absent: each its own, as in every codebook before them; codec/base.py)."""
        inputs = self.manifest.get("code_inputs", OWN_INPUTS)
        if inputs not in (OWN_INPUTS, ATTN_INPUTS):
            raise CodebookError(f"codebook manifest 'code_inputs' is {inputs!r}; this version reads {OWN_INPUTS} "
                                f"or {ATTN_INPUTS}: calibrate the codebook again with this version")
        return dict(inputs)

    def validate(self) -> None:
        for name, shape in self.expected_shapes().items():
            got = tuple(self.tensor(name).shape)
            if got != shape:
                raise CodebookError(f"codebook tensor '{name}' has shape {list(got)}, expected {list(shape)}")
        for name, t in self.tensors.items():
            if name.endswith(".enc"):
                stem = name[: -len(".enc")]
                need = max(self._ranks_of(stem), default=0)
                da = self.tensor(f"{stem}.mu_a").shape[0]
                if t.dim() != 2 or t.shape[0] != da or t.shape[1] < need:
                    raise CodebookError(f"codebook tensor '{name}' has shape {list(t.shape)}, "
                                        f"expected [{da}, >= {need}]")

    def _ranks_of(self, stem: str) -> list[int]:
        _, layer, s = stem.split(".")
        return [r for name in self.manifest.get("plans", {})
                for stream, r in self.plan(name).layers[int(layer)].streams if stream == s]

    # ---- I/O -----------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.tensors.items()}
        save_file(tensors, str(out / TENSORS))
        (out / TENSORS).chmod(0o644)  # safetensors writes 0600; a server run as another user must read it
        manifest = dict(self.manifest, version=CODEBOOK_VERSION,
                        tensors_sha256=_sha256(out / TENSORS), tensors_bytes=(out / TENSORS).stat().st_size)
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        self.manifest = manifest
        return out

    @classmethod
    def load(cls, directory: str | Path, producer: Any = None, consumer: Any = None) -> Codebook:
        root = Path(directory)
        try:
            manifest = json.loads((root / MANIFEST).read_text())
        except FileNotFoundError:
            raise CodebookError(f"{root}: no {MANIFEST}; not a codebook directory (run scd-serve calibrate)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CodebookError(f"{root / MANIFEST}: not valid JSON ({exc})") from None
        if not isinstance(manifest, dict) or manifest.get("version") != CODEBOOK_VERSION:
            got = manifest.get("version") if isinstance(manifest, dict) else None
            raise CodebookError(f"{root / MANIFEST}: codebook version {got!r}, this build reads {CODEBOOK_VERSION!r}")
        path = root / TENSORS
        if not path.exists():
            raise CodebookError(f"{root}: {TENSORS} is missing")
        size = path.stat().st_size
        if size != manifest.get("tensors_bytes"):
            raise CodebookError(f"{path}: {size} bytes, the manifest says {manifest.get('tensors_bytes')} "
                                "(truncated or replaced file)")
        if _sha256(path) != manifest.get("tensors_sha256"):
            raise CodebookError(f"{path}: checksum does not match the manifest (corrupt or replaced file)")
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # safetensors raises several kinds on a damaged header
            raise CodebookError(f"{path}: unreadable safetensors file ({exc})") from None
        book = cls(manifest, tensors)
        book.validate()
        book.check_models(producer, consumer)
        return book


def refuse_other_pair(path: str, model_flag: str, producer: Any = None, consumer: Any = None) -> None:
    """ConfigError (one line, what to do) when the codebook at `path` loads but was made for other
    models than these; a damaged one is left to the code that loads it for use."""
    try:
        Codebook.load(path, producer, consumer)
    except CodebookError as exc:
        if "calibrated for" in exc.message or "shape differs" in exc.message:
            raise ConfigError(f"--codebook {path} was made for another pair ({exc.message}); pass the codebook "
                              f"calibrated for this {model_flag} (scd-serve calibrate ... --out DIR), or "
                              f"--codebook '' to serve only the methods that need none") from None


def as_codebook(codebook: Any, producer: Any = None, consumer: Any = None) -> Codebook:
    """A loaded Codebook (checked against the models) from a directory or an instance."""
    if codebook is None:
        raise CodebookError("this method needs a codebook; run `scd-serve calibrate` and pass its directory")
    if isinstance(codebook, Codebook):
        codebook.check_models(producer, consumer)
        return codebook
    return Codebook.load(codebook, producer, consumer)
