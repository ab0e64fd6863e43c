"""What the connector did, in vLLM's own KV-transfer log line ("KV Transfer metrics: ..."):
loads and failures, the codes' bytes against what 16-bit raw K/V of the same rows would have
been, and the loads' time. Counters only, so workers' stats add up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

FIELDS = ("loads", "failed", "rows", "code_bytes", "raw_bytes", "load_s")


def empty() -> dict[str, float]:
    return dict.fromkeys(FIELDS, 0)


@dataclass
class SCDConnectorStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=empty)

    def record(self, *, failed: bool = False, rows: int = 0, code_bytes: int = 0, raw_bytes: int = 0,
               seconds: float = 0.0) -> None:
        d = self.data
        d["loads"] += 1
        d["failed"] += int(failed)
        d["rows"] += rows
        d["code_bytes"] += code_bytes
        d["raw_bytes"] += raw_bytes
        d["load_s"] += seconds

    def reset(self) -> None:
        self.data = empty()

    def aggregate(self, other: KVConnectorStats) -> "SCDConnectorStats":
        for key in FIELDS:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        d, done = self.data, self.data["loads"] - self.data["failed"]
        return {"scd_loads": int(d["loads"]), "scd_failed": int(d["failed"]), "scd_rows": int(d["rows"]),
                "scd_code_MB": round(d["code_bytes"] / 1e6, 3),
                "scd_vs_raw16": round(d["code_bytes"] / d["raw_bytes"], 3) if d["raw_bytes"] else 0.0,
                "scd_mean_load_s": round(d["load_s"] / done, 4) if done else 0.0}

    def is_empty(self) -> bool:
        return not self.data.get("loads")
