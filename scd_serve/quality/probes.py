"""Codecs measured on probe prompts, each with its replayed tail, and the choice of that tail.

A codec with `replay_tokens` R (codec/base.py) is sent the codes of all but the prompt's last
R handed-off tokens; the consumer computes those itself over the rebuilt rest (target-side
context replay, as Mixture-of-Translators does). Its figures must be measured the way it is
served, so `ReplayProbes` keeps one probe per R over the same prompts and scored positions.

Calibration tries the replays in `CalibrateConfig.replay` on the chosen scd plan and keeps the
shortest that meets the KL budget and the top-1 target; where none does, the one of best top-1
if it buys at least MIN_TOP1_GAIN over none. A replay costs the decode worker about R / T of
its own prefill of a T-token prompt; beside a run's share, it must fit max_rebuild on the
probe's prompts.
"""

from __future__ import annotations

from typing import Any, Callable

from scd_serve.codec.base import payload_bytes
from scd_serve.codec.codec_spec import spec_of
from scd_serve.codec.kl_probe import KLProbe, make_examples
from scd_serve.extras import tqdm

MIN_TOP1_GAIN = 0.005  # less than this over no replay is noise on a probe of a few thousand positions


class ReplayProbes:
    """The probe prompts at each replay: `at(0)` is `base` (or built), others are built on demand
    and only the latest is held (each holds a pool and both models' states per prompt)."""

    def __init__(self, producer: Any, consumer: Any, pairs: list, tail: int = 1, residual_layers=(),
                 base: KLProbe | None = None, show_progress: bool = True):
        self.producer, self.consumer, self.pairs, self.tail = producer, consumer, pairs, tail
        self.residual_layers, self.show_progress = tuple(residual_layers), show_progress
        self._held: dict[int, KLProbe] = {0: base} if base is not None else {}

    def at(self, replay: int) -> KLProbe:
        if replay not in self._held:
            with tqdm(total=len(self.pairs), desc=f"probe prompts, replay {replay}",
                      disable=not self.show_progress) as bar:
                examples = make_examples(self.producer, self.consumer, self.pairs, tail=self.tail, progress=bar.update,
                                         residual_layers=self.residual_layers, replay=replay)
            self._held = {r: p for r, p in self._held.items() if r == 0}
            self._held[replay] = KLProbe(self.consumer, examples)
        return self._held[replay]

    def replay_share(self, replay: int) -> float:
        """The replayed tokens' share of the probe prompts' handed-off tokens."""
        examples = self.at(replay).examples
        return sum(e.scored_from for e in examples) / max(1, sum(e.prefix + e.scored_from for e in examples))


def measure_codec(probe: KLProbe, codec: Any, consumer: Any) -> dict[str, float]:
    """KL and top-1 agreement on the probe's scored positions, and payload relative to raw
    16-bit K/V of the whole handoff (replayed tokens included: raw would ship them), through
    the real encode/decode."""
    nbytes = {"n": 0}

    def rebuild(ex, layer):
        code = codec.encode_layer(layer, ex.producer[layer])
        nbytes["n"] += payload_bytes(code)
        return codec.decode_layer(layer, code, consumer, tokens=ex.tokens)

    spec = spec_of(consumer)
    measured = probe.measure_all({i: rebuild for i in range(spec.num_layers)})
    raw = sum(e.prefix + e.scored_from for e in probe.examples) * spec.num_layers * 2 * spec.kv_width * 2
    return {"kl": measured.kl, "top1": measured.top1, "payload_ratio": nbytes["n"] / raw}


def measure_methods(probes: ReplayProbes, producer: Any, consumer: Any, book: Any,
                    show_progress: bool = True) -> dict[str, dict[str, float]]:
    """Every method a codebook serves (and prior-only, its zero-payload control) measured on the
    probe prompts at its own replay: the manifest's `calibration.methods` (calibrate's report,
    `scd-serve measure`)."""
    from scd_serve import codec as registry

    names = [m for m in registry.METHODS if m != "identity"] + ["prior-only"]
    codecs = {name: registry.build(name, producer=producer, consumer=consumer, codebook=book) for name in names}
    out = {}
    # by replay, so that each probe is built once
    for name in tqdm(sorted(names, key=lambda n: getattr(codecs[n], "replay_tokens", 0)),
                     desc="measure methods", disable=not show_progress):
        replay = int(getattr(codecs[name], "replay_tokens", 0))
        out[name] = measure_codec(probes.at(replay), codecs[name], consumer) | {"replay_tokens": replay}
    return {name: out[name] for name in names}


def choose_replay(probes: ReplayProbes, book: Any, candidates: tuple[int, ...], kl_budget: float, min_top1: float,
                  other_rebuild: float, max_rebuild: float, log: Callable[[str], None] = print) -> dict:
    """The scd plan measured at each candidate replay that fits the rebuild budget beside
    `other_rebuild` (a run's share) -> {"tokens": chosen, "measured": {R: figures}}."""
    from scd_serve import codec as registry

    measured: dict[int, dict[str, float]] = {}
    for replay in sorted(set(candidates) | {0}):
        share = probes.replay_share(replay) if replay else 0.0
        if replay and other_rebuild + share > max_rebuild:
            log(f"replay {replay}: {share:.2f} of the probe's prefill beside the run's {other_rebuild:.2f} is over "
                f"max_rebuild {max_rebuild}: not tried")
            continue
        book.manifest["replay_tokens"] = replay
        codec = registry.build("scd", producer=probes.producer, consumer=probes.consumer, codebook=book)
        measured[replay] = measure_codec(probes.at(replay), codec, probes.consumer) | {"share": share}
    chosen, meets = pick_replay(measured, kl_budget, min_top1)
    book.manifest["replay_tokens"] = chosen
    return {"tokens": chosen, "meets": meets, "measured": {str(r): m for r, m in measured.items()}}


def pick_replay(measured: dict[int, dict[str, float]], kl_budget: float, min_top1: float) -> tuple[int, bool]:
    """{replay: {kl, top1}} (0 among them) -> (the shortest replay meeting both targets, True), else
    (the one of best top-1 where it gains MIN_TOP1_GAIN over none, or 0; False)."""
    meets = [r for r, m in measured.items() if m["kl"] <= kl_budget and m["top1"] >= min_top1]
    if meets:
        return min(meets), True
    best = max(measured, key=lambda r: (measured[r]["top1"], -r))
    return (best if measured[best]["top1"] >= measured[0]["top1"] + MIN_TOP1_GAIN else 0), False
