"""RemoteKVFill: the engine's KVFill over gRPC. Pull codes, verify, rebuild layer by layer.

Per request: pick a prefill worker by load, then run the transfer in a transfer thread
(job.py, receive.py), every chunk checked BEFORE it is decoded and each layer rebuilt into the
request's blocks as it arrives; the event loop only waits for the thread. A retryable
failure tries another worker (up to max_attempts), then the engine may prefill locally; a
worker that answers "full" is waited for, like a busy one, until the request's deadline.
Cancellation cancels the stream and sends Abort to the prefill worker. A prompt that starts
with blocks in the engine's prefix cache asks for the codes of the rest only (sink.start).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import asdict, dataclass

import grpc

from scd_serve.config.decode import DecodeConfig
from scd_serve.control.lifecycle import detach
from scd_serve.codec.base import transferred
from scd_serve.codec.rebuild import all_finite, begin, checked_layer, codes_from, decodes_from
from scd_serve.decode.breaker import OPEN
from scd_serve.decode.job import TransferJob
from scd_serve.decode.receive import Received, check_header
from scd_serve.decode.shared import SharedTransfers
from scd_serve.decode.transfer import handoff
from scd_serve.engine.kv_budget import RAW_DTYPE_BYTES, bytes_per_token
from scd_serve.model.threads import one_thread
from scd_serve.errors import (DeadlineExceeded, IncompatiblePeer, Overloaded, ScdError, TransferCorrupt, TransferFailed,
                              TransferTimedOut, Unavailable)
from scd_serve.transport.chunking import StreamVerifier
from scd_serve.transport.proto import pb
from scd_serve.transport.tensors import LAST_H, LAST_K, LAST_V, split_last_row
from scd_serve.transport.status import from_rpc_error, is_retryable

log = logging.getLogger("scd_serve.decode")
RETRY_BACKOFF_S = 0.05
ABORT_TIMEOUT_S = 1.0
SLOT_POLL_S = 0.25
TRANSFER_THREADS = 16  # transfers in flight at once; more wait for a thread (within their deadline)


class ColdAtPeer(Unavailable):
    """The prefill worker has not cached the prompt's codes, which the `auto` choice counted on,
    and a local prefill beats a cold transfer: the engine prefills here. Armed only with
    fallback "local", so no client sees it."""

    retryable = False


@dataclass
class TransferStats:
    num_transfers: int = 0  # completed
    num_failed: int = 0  # attempts that failed
    num_retries: int = 0
    num_full_waits: int = 0  # "full" answers waited out (a worker's slot freed later than ours)
    num_cache_hits: int = 0  # producer served from its code cache
    payload_bytes: int = 0  # code bytes received
    raw_kv_bytes: int = 0  # what 16-bit K+V of the same tokens would have been
    encode_s: float = 0.0  # producer time reported in chunks
    rebuild_s: float = 0.0  # consumer decode_layer + write time
    transfer_s: float = 0.0  # first call to last chunk, wall time


class RemoteKVFill:
    def __init__(self, runtime, peers, codecs, config: DecodeConfig, metrics=None):
        self.rt = runtime
        self.metrics = metrics  # api.metrics.Metrics (observe_transfer) or None
        self.peers, self.codecs, self.config = peers, codecs, config
        self.stats = TransferStats()
        self.shared = SharedTransfers(runtime.spec.num_layers)  # transfers other requests may copy
        self.per_peer: Counter = Counter()  # completed transfers per prefill address
        self.num_inflight = 0  # transfers running now
        self._aborts: set[asyncio.Task] = set()
        self._freed = asyncio.Event()  # set whenever a transfer ends and frees a peer slot
        # a transfer writes one layer at a time beside the engine's forward: on one thread, so
        # that its team does not make libgomp put the engine's to sleep between ops (model/threads.py)
        self._threads = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="scd-transfer", initializer=one_thread)
        self._jobs: set[TransferJob] = set()
        self.num_cold_switches = 0  # transfers stopped at their header for a local prefill (ColdAtPeer)
        self.on_cold: Callable[[str, object], None] | None = None  # told (prefill address, request) of each
        # Told of every completed transfer: (prefill address, request, Received, wall seconds).
        self.on_transfer: Callable[[str, object, Received, float], None] | None = None
        # (Rebuild, request_id) -> Rebuild: wrappers of each request's rebuild (fault injection, tracing)
        self.codec_hooks: list[Callable[[object, str], object]] = []

    async def __call__(self, req, sink) -> dict:
        """Fill `sink` by a transfer, or by copying another request's for the same prompt (shared.py)."""
        key = (req.method, tuple(req.prompt_token_ids), sink.start)
        shared, leads = self.shared.join(key)
        got = None
        try:
            if not leads:
                got = await shared.replay(sink)
                self.shared.num_shared += got is not None
                return got if got is not None else await self._fill(req, sink)  # its transfer failed
            got = await self._fill(req, sink if shared is None else shared.tee(sink))
            return got
        finally:
            if shared is not None:
                if leads:
                    shared.end(got)  # None: failed, the readers run their own
                self.shared.leave(key, shared)

    async def _fill(self, req, sink) -> dict:
        tokens = handoff(req.prompt_token_ids)
        deadline = req.deadline or time.monotonic() + self.config.transport.prefill_timeout_s
        tried: list[str] = []
        errors: list[ScdError] = []
        full_answers = 0
        while len(errors) < self.config.max_attempts:
            if errors:
                await asyncio.sleep(RETRY_BACKOFF_S * len(errors))
            peer = await self._acquire(req, len(tokens), tried, deadline)
            if peer is None:
                break
            self.stats.num_retries += int(bool(errors))
            tried.append(peer.address)
            peer.breaker.started()
            try:
                with self.peers.balancer.track(peer.address):
                    got = await self._transfer(peer, req, tokens, sink)
                peer.breaker.succeeded()
                return got
            except ColdAtPeer as err:
                log.info("request_id=%s: %s", req.request_id, err.message)
                self.num_cold_switches += 1
                if self.on_cold is not None:
                    self.on_cold(peer.address, req)
                if self.metrics is not None:
                    self.metrics.observe_transfer(req.method, payload_bytes=0, outcome="cold-local")
                raise
            except Overloaded as err:
                # Full right now: its slot was not yet freed when ours was, or other decode workers
                # share it. Not a failure: wait for a slot (any worker, this one included) until
                # the request's deadline, as when every worker is busy.
                tried.remove(peer.address)
                full_answers += 1
                self.stats.num_full_waits += 1
                log.info("request_id=%s: %s; waiting for a slot", req.request_id, err.message)
                if time.monotonic() + SLOT_POLL_S > deadline:
                    raise DeadlineExceeded(f"request {req.request_id} waited its deadline for a prefill slot "
                                           f"({full_answers} full answers)") from err
                await asyncio.sleep(min(RETRY_BACKOFF_S * full_answers, SLOT_POLL_S))
            except ScdError as err:
                self.stats.num_failed += 1
                errors.append(err)
                log.warning("request_id=%s transfer from %s failed (%s): %s", req.request_id, peer.address,
                            err.kind, err.message)
                if isinstance(err, IncompatiblePeer):
                    peer.problem = f"incompatible: {err.message}"  # the health loop re-handshakes it
                if not sink.closed:  # a request that ended meanwhile says nothing about the worker
                    self._judge(peer, err)
                if not is_retryable(err):
                    break
            finally:
                peer.breaker.released()
        if self.metrics is not None:
            self.metrics.observe_transfer(req.method, payload_bytes=0, outcome="failed")
        raise self._final_error(req, tried, errors)

    def _judge(self, peer, err: ScdError) -> None:
        """Count a failure against the worker's breaker when it broke, hung or corrupted the
        transfer (a full worker or the request's own deadline say nothing about its health)."""
        if isinstance(err, (TransferFailed, TransferCorrupt)):
            peer.breaker.failed()
            if peer.breaker.state == OPEN:
                log.warning("prefill %s: %s", peer.address, peer.breaker.describe())

    async def _acquire(self, req, num_tokens: int, tried: list[str], deadline: float):
        """A peer with a free slot, waiting (until `deadline`) while all are busy; None when no
        usable peer serves the method at all."""
        first = self._preferred(req, num_tokens, tried)
        if first is not None:
            return first
        while True:
            peer = self.peers.choose(req.method, num_tokens, exclude=tried)
            if peer is not None or not [p for p in self.peers.serving(req.method, num_tokens)
                                        if p.address not in tried]:
                return peer
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"request {req.request_id} waited its deadline for a prefill slot")
            self._freed.clear()
            # woken by a finished transfer; re-checked at least every SLOT_POLL_S for peer changes
            with suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), timeout=min(left, SLOT_POLL_S))

    def _preferred(self, req, num_tokens: int, tried: list[str]):
        """The peer the request was routed to (the `auto` choice) when it still serves the
        method and has a free slot; else None (the load-aware choice decides)."""
        address = req.transfer.take_peer() if req.transfer is not None else ""
        peer = self.peers.peers.get(address)
        if peer is None or address in tried or all(p is not peer for p in self.peers.serving(req.method, num_tokens)):
            return None
        limit = peer.info.max_concurrent
        return peer if not limit or self.peers.balancer.inflight[address] < limit else None

    def _final_error(self, req, tried: list[str], errors: list[ScdError]) -> ScdError:
        if not errors:
            return Unavailable(f"no ready prefill worker offers method {req.method!r} "
                               f"({self.peers.why_not_ready() or 'all busy or excluded'})")
        last = errors[-1]
        if isinstance(last, TransferFailed) and not isinstance(last, TransferTimedOut):
            return Unavailable(f"transfer failed on {len(tried)} prefill worker(s): {last.message}")
        return last

    async def _transfer(self, peer, req, tokens: list[int], sink) -> dict:
        codec = self.codecs.get(peer.info, req.method)
        rid = req.request_id
        start = time.monotonic()
        deadline = start + self.config.transport.prefill_timeout_s
        if req.deadline is not None:
            deadline = min(deadline, req.deadline)
        if deadline <= start:
            raise DeadlineExceeded(f"request {rid} has no time left for a transfer")
        # Rows sink.start.. are missing here (those before were in the prefix cache): raw K/V
        # would ship them all; a replayed tail is prefilled here (codec/base.py), at least one
        # row is shipped; a codec whose rows do not decode alone is sent them all, and a codec's
        # head is computed here: its codes start after it (rebuild.py).
        held = sink.start
        num_needed = len(tokens) - held
        tokens = tokens[:max(held + 1, transferred(codec, len(tokens)))]
        sink.limit(len(tokens))
        ship_from = decodes_from(codec, held)
        first = codes_from(codec, ship_from, len(tokens))
        request = pb.PrefillRequest(request_id=rid, token_ids=tokens, method=req.method, start=first,
                                    consumer_fingerprint=self.rt.fingerprint)
        if getattr(sink, "takes_last_row", False) and peer.info.producer_fingerprint == self.rt.fingerprint:
            # the worker runs this model: it may prefill the last token too and ship the first step
            request.last_token = req.prompt_token_ids[-1]
        rebuild = begin(codec, tokens, self.rt, ship_from)  # the prompt's decode side (codec/rebuild.py)
        for hook in self.codec_hooks:
            rebuild = hook(rebuild, rid)

        def check(header) -> None:
            check_header(header, peer, codec)
            self._check_cold(header, peer, req.transfer)

        verifier = StreamVerifier(rid, req.method, len(tokens) - first, self.rt.spec.num_layers,
                                  check_header=check)
        job = TransferJob(peer, request, deadline)
        self._jobs.add(job)
        self.num_inflight += 1
        ok = server_ended = False
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        try:
            job.start()  # the request leaves now, while a transfer thread wakes up to read the answer
            self._threads.submit(job.run, loop, done, verifier, lambda: self._prepare(rebuild, sink),
                                 lambda layer, code: self.rebuild_layer(layer, code, rebuild, sink, held - ship_from))
            got = await self._watch(job, done)
            ok = True
        except grpc.RpcError as exc:
            server_ended = True
            err = from_rpc_error(exc, peer.address)
            if isinstance(err, DeadlineExceeded) and deadline < (req.deadline or float("inf")):
                # the transfer's own deadline (prefill_timeout_s), not the request's: it may still
                # be served by another worker or locally
                err = TransferTimedOut(f"prefill worker {peer.address} did not finish the transfer within "
                                       f"{deadline - start:.1f} s (prefill_timeout_s)")
            raise err from None
        finally:
            self._jobs.discard(job)
            self.num_inflight -= 1
            self._freed.set()
            if not ok:
                done.cancel()  # nobody waits for it now: the thread's outcome must not land there
                job.cancel()  # a cancelled wait leaves the thread reading: stop its stream
                if not server_ended:  # we walked away (cancelled, corrupt chunk): tell the producer
                    self._abort_remote(peer, rid)
        s = self.stats
        s.num_transfers += 1
        s.num_cache_hits += int(got.cache_hit)
        s.payload_bytes += got.payload_bytes
        spec = self.rt.spec
        raw = num_needed * bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, RAW_DTYPE_BYTES)
        s.raw_kv_bytes += raw
        s.encode_s += got.encode_us / 1e6
        s.rebuild_s += got.rebuild_s
        elapsed = time.monotonic() - start
        s.transfer_s += elapsed
        self.per_peer[peer.address] += 1
        if self.metrics is not None:
            self.metrics.observe_transfer(req.method, payload_bytes=got.payload_bytes, raw_bytes=raw,
                                          encode_s=got.encode_us / 1e6, rebuild_s=got.rebuild_s, transfer_s=elapsed)
        if self.on_transfer is not None:
            try:
                self.on_transfer(peer.address, req, got, elapsed)
            except Exception:  # noqa: BLE001 - bookkeeping must never fail a transfer that succeeded
                log.exception("request_id=%s: recording the transfer failed", rid)
        return {"prefill": peer.address, "payload_bytes": got.payload_bytes, "raw_kv_bytes": raw,
                "cache_hit": got.cache_hit, "rebuild_s": got.rebuild_s, "cached_tokens": held,
                "replayed_tokens": held + num_needed - len(tokens)}

    async def _watch(self, job: TransferJob, done: asyncio.Future):
        """Wait for the transfer, giving the worker up as hung once its stream has been silent
        for stall_timeout_s (time waiting for a free transfer thread does not count)."""
        stall_s = self.config.transport.stall_timeout_s
        while True:
            quiet = time.monotonic() - job.last_message if job.reading else 0.0
            try:
                return await asyncio.wait_for(asyncio.shield(done), max(0.01, stall_s - quiet))
            except TimeoutError:
                if job.reading and time.monotonic() - job.last_message >= stall_s:
                    raise TransferTimedOut(f"prefill worker {job.peer.address} sent nothing for {stall_s:g} s "
                                           f"(stall_timeout_s): given up as hung") from None

    def _check_cold(self, header, peer, transfer) -> None:
        """The prefill side says early whether it holds the codes: stop a cold transfer the
        `auto` choice would rather have prefilled here (local_if_cold)."""
        if not header.cache_hit and transfer is not None and transfer.local_if_cold:
            raise ColdAtPeer(f"prefill {peer.address} has no cached codes for this prompt ({header.codec_id}); "
                             f"a local prefill is predicted faster than a cold transfer")

    def _prepare(self, rebuild, sink) -> None:
        """The rebuild's prompt-only work, while the first chunk is on its way."""
        try:
            sink.prepare()
            rebuild.prepare()
        except ScdError:
            raise
        except Exception as exc:  # a local fault, not the peer's: this transfer fails, the worker lives
            raise TransferFailed(f"preparing the rebuild failed: {type(exc).__name__}: {exc}") from None

    def rebuild_layer(self, layer: int, code: dict, rebuild, sink, skip: int = 0) -> None:
        """One layer's code into the sink, less its first `skip` rows (held here already); the
        prompt's last row first where the producer shipped it (last-row handoff)."""
        code, last = split_last_row(code)
        if last:
            k, v, h = last.get(LAST_K), last.get(LAST_V), last.get(LAST_H)
            if not all(all_finite(t) for t in (k, v, h) if t is not None):
                raise TransferCorrupt(f"layer {layer}: the last row is non-finite: refused before the cache")
            sink.write_last_row(layer, k, v, h)
        sink.write_layer(layer, *checked_layer(rebuild, layer, code, skip))

    def _abort_remote(self, peer, rid: str) -> None:
        async def abort():
            with suppress(grpc.aio.AioRpcError):  # the peer is gone; its lease frees the transfer
                await peer.client.abort(rid, "decode side stopped reading", timeout=ABORT_TIMEOUT_S)
        detach(abort(), self._aborts)

    def close(self) -> None:
        """Shutdown: cancel the transfers' streams so that no thread waits on them."""
        for job in list(self._jobs):
            job.cancel()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def snapshot(self) -> dict:
        return asdict(self.stats) | {"per_prefill": dict(self.per_peer), "inflight": self.num_inflight,
                                     "cold_switches": self.num_cold_switches, "shared": self.shared.num_shared}
