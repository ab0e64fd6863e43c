"""Bandwidth and size units: parse what users type, print what people read.

Bandwidths are held as bytes per second internally; links are quoted in bits
("100mbit", "10gbit", "25Gbps") and memory in bytes ("1500GB/s").
"""

from __future__ import annotations

import re

from scd_serve.errors import ConfigError

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BW = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|bps|b/s|byte/s|bytes/s)?\s*$", re.I)


def parse_bandwidth(text: str) -> float:
    """'100mbit' | '10Gbps' | '2.5gbit' | '1500MB/s' -> bytes per second."""
    m = _BW.match(str(text))
    if not m:
        raise ConfigError(f"bandwidth {text!r} not understood; write e.g. 100mbit, 10gbit, 25Gbps or 1500MB/s",
                          field="bandwidth")
    value, prefix, unit = float(m.group(1)), m.group(2), (m.group(3) or "bit")
    is_bytes = unit.lower().startswith("byte") or unit == "B/s"  # 'b/s', 'bit', 'bps' are bits
    scale = _PREFIX[prefix.lower()]
    bps = value * scale if is_bytes else value * scale / 8.0
    if bps <= 0:
        raise ConfigError(f"bandwidth {text!r} must be positive", field="bandwidth")
    return bps


def tc_rate(bytes_per_s: float) -> str:
    """Bytes/s -> a `tc` rate string in whole kbit (tc accepts 'NNNkbit')."""
    return f"{max(8, int(round(bytes_per_s * 8 / 1e3)))}kbit"


def fmt_bandwidth(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit", 1e12), ("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g}{unit}"
    return f"{bits:.4g}bit"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"
