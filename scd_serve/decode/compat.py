"""Handshake check: does a prefill worker produce what this decode worker can rebuild?

Returns the differing fields by name, so /ready and the log say exactly what to fix.
"""

from __future__ import annotations

from scd_serve.transport.proto import PROTOCOL_VERSION


def compat_problems(info, consumer_spec, method: str, codecs, expect_producer: str = "") -> list[str]:
    """[] if compatible; else one 'field: theirs != ours' line per difference."""
    problems = []
    if info.protocol_version != PROTOCOL_VERSION:
        problems.append(f"protocol_version: {info.protocol_version} != {PROTOCOL_VERSION}")
    for field, ours in (("num_layers", consumer_spec.num_layers), ("num_kv_heads", consumer_spec.num_kv_heads),
                        ("head_dim", consumer_spec.head_dim)):
        if getattr(info, field) != ours:
            problems.append(f"{field}: producer {getattr(info, field)} != consumer {ours}")
    if expect_producer and info.producer_fingerprint != expect_producer:
        problems.append(f"producer_fingerprint: {info.producer_fingerprint} != expected {expect_producer}")
    if method in ("local", "auto") or problems:  # auto: each method is checked when the chooser asks
        return problems
    return problems + method_problems(info, method, codecs)


def method_problems(info, method: str, codecs) -> list[str]:
    """[] if this worker can rebuild `method` from the producer `info` describes."""
    problems = []
    offered = {c.codec_id: c for c in info.codecs}
    theirs = offered.get(method)
    if theirs is None:
        return [f"codecs: method {method!r} not offered (offers {sorted(offered)})"]
    why = codecs.can_build(info, method)
    if why:
        return [f"codecs: cannot build consumer half of {method!r}: {why}"]
    ours = codecs.get(info, method)
    if theirs.codec_version != ours.version:
        problems.append(f"codec_version[{method}]: {theirs.codec_version} != {ours.version}")
    calibrated_for = getattr(ours, "producer_fingerprint", "") or ""
    if calibrated_for and info.producer_fingerprint != calibrated_for:
        problems.append(f"producer_fingerprint: {info.producer_fingerprint} != {calibrated_for} "
                        f"(the codebook of {method!r} was calibrated for it)")
    our_book = getattr(ours, "codebook_id", "") or ""
    if theirs.codebook_id != our_book:
        problems.append(f"codebook_id[{method}]: {theirs.codebook_id or '-'} != {our_book or '-'}")
    return problems
