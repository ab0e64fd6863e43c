"""The prefill worker's gRPC service: run the producer, encode and stream each layer.

Each Prefill call is one transfer: admitted at once or refused with RESOURCE_EXHAUSTED, and
bounded by min(RPC deadline, transfer lease, the request's timeout_ms). The producer runs in
a thread and hands each encoded layer over as soon as it is done, so the first chunk leaves
while later layers still compute.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from scd_serve.codec.base import wants_residuals
from scd_serve.config.prefill import PrefillConfig
from scd_serve.errors import (DeadlineExceeded, IncompatiblePeer, InvalidRequest, Overloaded,
                              PayloadTooLarge, ScdError, TransferFailed)
from scd_serve.model.runtime import PrefillIterator
from scd_serve.prefill.code_cache import CodeCache, cache_key
from scd_serve.prefill.prefix import PrefixStates
from scd_serve.prefill.metrics import PrefillMetrics
from scd_serve.transport.chunking import chunk_message, group_layers
from scd_serve.transport.proto import PROTOCOL_VERSION, pb, pb_grpc
from scd_serve.transport.status import abort_with
from scd_serve.transport.tensors import LAST_H, LAST_K, LAST_V, encode_code

log = logging.getLogger("scd_serve.prefill")
MAX_REQUEST_ID = 128
FRAMING = 1024  # room left in max_message_bytes for a chunk's non-tensor fields and the header
_DONE = object()


class Aborted(Exception):
    """The decode side called Abort for this transfer."""


@dataclass
class Transfer:
    request_id: str
    expires: float  # time.monotonic() at which the lease or the RPC deadline runs out
    task: asyncio.Task | None = None  # the RPC's handler task; Abort cancels it
    stop: threading.Event = field(default_factory=threading.Event)  # tells the producer thread
    aborted: bool = False
    sent_bytes: int = 0  # chunk messages written so far
    cache_hit: bool = False

    def abort(self) -> None:
        self.stop.set()
        if not self.aborted and self.task is not None:
            self.aborted = True
            self.task.cancel()


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, runtime, codecs: dict, config: PrefillConfig, metrics: PrefillMetrics | None = None,
                 experts: list[dict] = ()):
        self.rt = runtime
        self.codecs = codecs  # method name -> TransferCodec (producer half)
        # the codebook methods of further consumers (experts) this producer feeds, one dict each:
        # a request gets the codec made for its consumer (PrefillRequest.consumer_fingerprint)
        self.experts = list(experts)
        self.config = config
        self.cache = CodeCache(config.cache_bytes, config.cache_entries)
        self.transfers: dict[str, Transfer] = {}
        self.max_prompt_tokens = config.max_prompt_tokens or runtime.spec.max_position_embeddings
        if hasattr(runtime, "max_prompt_tokens"):  # an engine with its own limit (vLLM's)
            self.max_prompt_tokens = min(self.max_prompt_tokens, runtime.max_prompt_tokens)
        self.prefix = PrefixStates(runtime, config.prefix_cache_tokens) if config.prefix_cache_tokens else None
        self.num_served = 0  # completed transfers
        self.num_prefills = 0  # producer runs (cache misses that started)
        self.num_failed = 0
        self.metrics = metrics or PrefillMetrics()
        self.metrics.watch(self.load_report)

    # ---- handshake -----------------------------------------------------------------------
    async def Info(self, request, context):
        s = self.rt.spec
        return pb.InfoReply(
            protocol_version=PROTOCOL_VERSION, producer_fingerprint=self.rt.fingerprint,
            model_family=s.family, num_layers=s.num_layers, num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim, compute_dtype=str(self.rt.dtype).removeprefix("torch."),
            codecs=[pb.CodecInfo(codec_id=name, codec_version=c.version,
                                 codebook_id=getattr(c, "codebook_id", "") or "")
                    for codecs in (self.codecs, *self.experts) for name, c in codecs.items()],
            max_message_bytes=self.config.transport.max_message_bytes,
            max_prompt_tokens=self.max_prompt_tokens, hidden_size=s.hidden_size, rope_theta=s.rope_theta,
            max_concurrent=self.config.max_concurrent)

    async def Abort(self, request, context):
        t = self.transfers.get(request.request_id)
        if t is not None:
            log.info("abort request_id=%s reason=%s", request.request_id, request.reason[:200])
            t.abort()
        return pb.AbortReply(was_running=t is not None)

    def load_report(self) -> dict:
        """What heartbeats report (plain numbers)."""
        return {"running": len(self.transfers), "waiting": 0, "capacity": self.config.max_concurrent,
                "served": self.num_served, "prefills": self.num_prefills, "failed": self.num_failed,
                "cache_hits": self.cache.num_hits, "cache_entries": len(self.cache),
                "cache_bytes": self.cache.num_bytes}

    # ---- the transfer --------------------------------------------------------------------
    async def Prefill(self, request, context):
        rid = request.request_id
        tokens = list(request.token_ids)  # once: every pass over the protobuf field costs ~60 us per 1k tokens
        try:
            codec = self._admit(request, tokens)
        except ScdError as err:
            await abort_with(context, err)
        limits = [self.config.transfer_lease_s, context.time_remaining(),
                  request.timeout_ms / 1e3 if request.timeout_ms else None]
        t = Transfer(rid, time.monotonic() + min(x for x in limits if x is not None), task=asyncio.current_task())
        self.transfers[rid] = t
        started, outcome = time.perf_counter(), "failed"
        try:
            await self._bounded(request, tokens, codec, t, context)
            self.num_served += 1
            outcome = "served"
        except ScdError as err:
            self.num_failed += 1
            await abort_with(context, err)
        except Aborted:
            self.num_failed += 1
            outcome = "aborted"
            await abort_with(context, TransferFailed(f"transfer {rid} aborted by the decode side"))
        except asyncio.CancelledError:  # the client went away or the deadline hit
            self.num_failed += 1
            outcome = "cancelled"
            log.info("transfer cancelled request_id=%s", rid)
            raise
        finally:
            t.stop.set()
            self.transfers.pop(rid, None)
            self.metrics.observe(request.method, outcome, len(tokens), t.sent_bytes, time.perf_counter() - started,
                                 t.cache_hit)

    async def _bounded(self, request, tokens: list[int], codec, t: Transfer, context) -> None:
        """The whole stream under one deadline (lease or RPC deadline) and one abort switch: one
        guard, not one per write (two tasks each: most of a cached resend's Python time). Abort
        cancels this task; t.aborted tells it from the client going away (which propagates)."""
        task, timeout = t.task, asyncio.timeout(max(0.0, t.expires - time.monotonic()))
        try:
            async with timeout:
                await self._stream(request, tokens, codec, t, context)
        except TimeoutError:
            if timeout.expired():
                raise DeadlineExceeded(f"transfer {t.request_id} ran past its deadline or lease") from None
            raise
        except asyncio.CancelledError:
            if t.aborted and task is not None and task.uncancel() == 0:
                raise Aborted() from None
            raise
        finally:
            t.task = None  # from here on an Abort finds nothing to cancel (the status is being sent)

    def _admit(self, request, tokens: list[int]):
        rid, n = request.request_id, len(tokens)
        if not rid or len(rid) > MAX_REQUEST_ID:
            raise InvalidRequest(f"request_id must be 1..{MAX_REQUEST_ID} characters", field="request_id")
        if rid in self.transfers:
            raise InvalidRequest(f"request_id {rid} is already transferring", field="request_id")
        if not 1 <= n <= self.max_prompt_tokens:
            raise InvalidRequest(f"token_ids has {n} tokens; must be 1..{self.max_prompt_tokens}",
                                 field="token_ids")
        if request.start >= n:
            raise InvalidRequest(f"start {request.start} leaves no token of {n} to transfer; must be < {n}",
                                 field="start")
        vocab = self.rt.spec.vocab_size
        if max(tokens) >= vocab:
            raise InvalidRequest(f"token id {max(tokens)} >= vocab size {vocab}", field="token_ids")
        if request.HasField("last_token") and request.last_token >= vocab:
            raise InvalidRequest(f"last_token {request.last_token} >= vocab size {vocab}", field="last_token")
        offered = [c[request.method] for c in (self.codecs, *self.experts) if request.method in c]
        if not offered:
            raise InvalidRequest(f"method {request.method!r} not served here; have {sorted(self.codecs)}",
                                 field="method")
        asked = request.consumer_fingerprint
        codec = next((c for c in offered if getattr(c, "consumer_fingerprint", "") in ("", asked)), offered[0])
        want = getattr(codec, "consumer_fingerprint", "")
        if want and asked and want != asked:
            made_for = ", ".join(sorted({getattr(c, "consumer_fingerprint", "") for c in offered}))
            raise IncompatiblePeer(f"no codebook of {request.method!r} here is for consumer {asked} "
                                   f"(they are for {made_for})")
        if len(self.transfers) >= self.config.max_concurrent:
            raise Overloaded(f"prefill worker runs {len(self.transfers)} transfers (max_concurrent)")
        return codec

    async def _stream(self, request, tokens: list[int], codec, t: Transfer, context) -> None:
        s = self.rt.spec
        key = cache_key(request.method, codec.version, tokens, request.start)
        cached = self.cache.get(key)
        ranges = group_layers(cached, self.config.chunk_bytes, keep_ends=True) if cached else \
            [(i, i + 1) for i in range(s.num_layers)]
        header = pb.TransferHeader(
            request_id=t.request_id, codec_id=request.method, codec_version=codec.version,
            producer_fingerprint=self.rt.fingerprint, consumer_fingerprint=request.consumer_fingerprint,
            num_tokens=len(tokens) - request.start, num_layers=s.num_layers, total_chunks=len(ranges),
            num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, cache_hit=cached is not None, start=request.start)
        if cached is not None:  # codes ready: the header rides with chunk 0 (one write less before it)
            t.cache_hit = True
            for seq, (a, b) in enumerate(ranges):
                tensors = [m for layer in cached[a:b] for m in layer]
                msg = chunk_message(t.request_id, seq, len(ranges), a, b, tensors, header=header if seq == 0 else None)
                await context.write(msg)
                t.sent_bytes += msg.ByteSize()
            return
        first = pb.PrefillChunk(header=header)
        await context.write(first)  # at once: the producer takes a while
        t.sent_bytes += first.ByteSize()
        # the same method by the other experts' codebooks, encoded from this one prefill and
        # cached: an expert that reads the prompt next is served without a prefill of its own
        siblings = [c[request.method] for c in (self.codecs, *self.experts)
                    if request.method in c and c[request.method].version != codec.version]
        made = await self._produce_and_send(tokens, request.start, [codec, *siblings], t, context, len(ranges),
                                            self._last_token(request, tokens))
        for c, layers in zip([codec, *siblings], made):
            self.cache.put(cache_key(request.method, c.version, tokens, request.start), layers)

    def _last_token(self, request, tokens: list[int]) -> int | None:
        """The prompt's last token where this worker runs the asking consumer's own model (the
        last-row handoff: its row rides along, so the decode side skips its first step), else None."""
        if not request.HasField("last_token") or request.consumer_fingerprint != self.rt.fingerprint:
            return None
        if not getattr(self.rt, "computes_last_row", False) or len(tokens) >= self.rt.spec.max_position_embeddings:
            return None
        return request.last_token

    async def _produce_and_send(self, tokens, start: int, codecs: list, t: Transfer, context,
                                total: int, last_token: int | None = None) -> list[list[list]]:
        """Stream codecs[0]'s codes (and the last row, where asked) as the producer makes them;
        -> every codec's layers (codes only: they are what the code cache keeps)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item) -> None:
            if not loop.is_closed():  # the server stopped while this prefill ran
                loop.call_soon_threadsafe(queue.put_nowait, item)

        self.num_prefills += 1
        # a thread per prefill (admission bounds them), gone when it is: a pool's idle threads would
        # each keep an OpenMP team, and with more teams than CPUs libgomp sleeps every team's workers
        # between ops (model/threads.py): after a burst of streams, a 1k prompt's P/D TTFT 1.38 s
        # against 1.16 s this way (docs/benchmarks.md, with what it costs concurrent streams)
        threading.Thread(target=_produce, args=(self.rt, codecs, tokens, start, t.stop, emit, self.prefix, last_token),
                         name="producer", daemon=True).start()
        made: list[list[list]] = [[] for _ in codecs]
        while True:
            item = await queue.get()
            if item is _DONE:
                return made
            if isinstance(item, BaseException):
                log.error("producer failed request_id=%s: %s", t.request_id, item)
                raise TransferFailed(f"producer failed on layer {len(made[0])}: {type(item).__name__}")
            layer, per_codec, us, last_row = item
            for layers, tensors in zip(made[1:], per_codec[1:]):
                layers.append(tensors)
            tensors = per_codec[0]
            msg = chunk_message(t.request_id, layer, total, layer, layer + 1, tensors + last_row, us)
            if msg.ByteSize() > self.config.transport.max_message_bytes - FRAMING:
                raise PayloadTooLarge(f"layer {layer} code is {msg.ByteSize()} bytes, over max_message_bytes "
                                      f"({self.config.transport.max_message_bytes}); raise --max-message-mb "
                                      f"or send a shorter prompt")
            await context.write(msg)
            t.sent_bytes += msg.ByteSize()
            made[0].append(tensors)

    def close(self) -> None:
        for t in list(self.transfers.values()):
            t.stop.set()


def _produce(rt, codecs: list, tokens: list[int], first: int, stop: threading.Event, emit,
             prefix: PrefixStates | None = None, last_token: int | None = None) -> None:
    """Worker thread: prefill layer by layer (from the producer's cached prefix on, where it
    holds one), encode the rows from position `first` on (the states of every earlier token
    shaped them) by each codec, hand each layer over at once.

    With last_token, the prompt's last token is prefilled too: its row of every layer ("last.k",
    "last.v", pre-RoPE) rides with that layer's codes, and the last layer's output ("last.h",
    [1, hidden]) with the last layer's, which waits for it."""
    states, held = None, None
    n, last_layer = len(tokens), rt.spec.num_layers - 1
    start = time.perf_counter()

    def send(layer: int, codes: list, last_row: list) -> None:
        nonlocal start
        now = time.perf_counter()
        emit((layer, codes, int((now - start) * 1e6), last_row))
        start = now

    try:
        full = tokens if last_token is None else [*tokens, last_token]
        states = prefix.layers(full, first, last_token is not None) if prefix is not None else None
        if states is None:
            ids = torch.tensor(full, dtype=torch.long)  # ids: [T] (with the last token where asked)
            residuals = any(wants_residuals(c, rt.spec.num_layers) for c in codecs)
            states = rt.iter_prefill(ids, compute_logits=False, residuals=residuals,
                                     **({"last_hidden": True} if last_token is not None else {}))
        states = PrefillIterator(states)  # keeps what the run ends with (a wrapped runtime's too)
        for layer, state in states:
            if stop.is_set():
                return
            last_row: dict = {}
            if state.start + state.keys.shape[0] > n:  # the last token's row came too
                last_row = {LAST_K: state.keys[-1:], LAST_V: state.values[-1:]}  # [1, kv_heads, hd] each
            rows_out = state.rows_from(first, n) if last_row or first else state
            codes = [encode_code(layer, c.encode_layer(layer, rows_out)) for c in codecs]
            if last_row and layer == last_layer:
                held = (layer, codes, encode_code(layer, last_row))  # sent with the final row's output
                continue
            send(layer, codes, encode_code(layer, last_row))
        if held is not None:
            layer, codes, last_row = held
            if states.logits is not None:  # a last-row run's: the last layer's output [1, hidden]
                last_row += encode_code(layer, {LAST_H: states.logits})
            send(layer, codes, last_row)
        emit(_DONE)
    except BaseException as exc:  # noqa: BLE001 - handed to the loop, which fails the RPC
        emit(exc)
    finally:
        if hasattr(states, "close"):  # a prefix run stopped half way frees its blocks now
            states.close()
