"""GenerationDefaults: what a model's generation_config.json says about stopping and sampling.

Chat models often end a turn with a token that is not the tokenizer's eos (Llama 3's
<|eot_id|>, Qwen's <|im_end|>): generation_config.json's `eos_token_id` lists them. Its
sampling values are the defaults of a request that leaves them out (vLLM's
`--generation-config auto`). An id stops generation only if the tokenizer holds it as a
special or added token: files written from a config's defaults can name an ordinary byte
token, which would cut replies short at random. A missing file means no ids, no defaults.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("scd_serve.engine")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: frozenset[int] = frozenset()
    sampling: dict[str, float | int] = field(default_factory=dict)  # request field -> default value

    @classmethod
    def load(cls, model_dir: str | Path | None) -> GenerationDefaults:
        if model_dir is None:
            return cls()
        path = Path(model_dir) / "generation_config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            log.warning("%s unreadable (%s): no defaults from it", path, exc)
            return cls()
        return cls.from_dict(raw if isinstance(raw, dict) else {})

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GenerationDefaults:
        eos = raw.get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos]
        eos_ids = frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)
        sampling = {k: raw[k] for k in SAMPLING_KEYS
                    if isinstance(raw.get(k), (int, float)) and not isinstance(raw.get(k), bool)}
        return cls(eos_ids, sampling)

    def stop_ids(self, tokenizer: Any) -> frozenset[int]:
        """The eos ids the tokenizer holds as special or added tokens (others logged, unused)."""
        known = set(getattr(tokenizer, "all_special_ids", None) or ())
        known |= set(getattr(tokenizer, "added_tokens_decoder", None) or {})
        if dropped := sorted(self.eos_token_ids - known):
            log.warning("generation_config.json eos_token_id %s: not special tokens of this tokenizer; "
                        "not used to stop", dropped)
        return frozenset(self.eos_token_ids & known)
