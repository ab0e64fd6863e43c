"""Shared by the engine loop tests: a small config, a request, collecting a generation, the clean state."""

import asyncio
import time

import torch

from scd_serve.config.engine import EngineConfig
from scd_serve.engine.request import GenerationRequest, SamplingParams
from scd_serve.engine.sampler import _by_cut, candidates, shape_batch


def probabilities(logits, params):
    """logits [vocab] with one SamplingParams, or [B, vocab] with one per row -> the sampler's
    probs (float64, same shape) after temperature, top_k, top_p and min_p."""
    if logits.dim() == 1:
        return probabilities(logits[None], [params])[0]
    out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
    for group in _by_cut(range(len(params)), params, logits.shape[-1]):
        probs, ids = candidates(logits[group], [params[i] for i in group])
        out[group] = probs if ids is None else torch.zeros_like(out[group]).scatter_(1, ids, probs)
    return out


def shape_logits(row, seq, eos_token_ids):
    """In place, one row [vocab]: the sampler's penalties, bias, and min_tokens mask."""
    row.copy_(shape_batch(row[None], [seq], eos_token_ids)[0])


def cfg(**kw):
    base = dict(num_blocks=64, block_size=4, max_model_len=128, max_num_seqs=16, max_concurrent=32,
                max_prefill_tokens=16, idle_poll_s=0.01, stall_timeout_s=1.0)
    base.update(kw)
    return EngineConfig(**base)


def req(rid, prompt, **params):
    params.setdefault("temperature", 0)
    params.setdefault("max_tokens", 8)
    return GenerationRequest(rid, list(prompt), SamplingParams(**params))


async def collect(eng, r, kv_fill=None):
    events = [e async for e in eng.generate(r, kv_fill)]
    return [e.token_id for e in events if e.token_id is not None], events


async def refused_at_once(eng, r, error):
    """Run request `r` and expect `error`, raised before the event loop ran anything else: the
    engine refused it on admission, without queueing it or waiting for anything. (A wall-clock
    bound like "< 0.1 s" is what this replaces: a loaded machine exceeds it.) -> the error."""
    turned = []
    asyncio.get_running_loop().call_soon(turned.append, True)
    try:
        await collect(eng, r)
    except error as exc:
        assert not turned, "the request was refused only after waiting (the event loop turned)"
        return exc
    raise AssertionError(f"{r.request_id} was not refused with {error.__name__}")


async def wait_clean(eng, timeout=2.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = eng.stats()
        if s["num_free_blocks"] == s["num_total_blocks"] and not eng.scheduler.has_unfinished() \
                and s["num_requests"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not back to clean state: {eng.stats()}")
