"""CodeSource: one prompt's K/V from scd-serve prefill workers, for a vLLM consumer.

Plain blocking code for vLLM's worker thread (no event loop, no vLLM import: the main suite
tests it against a real prefill worker). Per prompt: a worker, handshaken once (the same
checks as a decode worker's: protocol, shapes, method, codec version, codebook, producer),
is asked over the existing Prefill stream for the rows start..; each chunk is verified, each
layer rebuilt by the codec's consumer half on this process's own copy of the consumer (its
embeddings and the layers a Patch or a run computes) and handed on with the consumer's RoPE
applied. A failed worker gives way to the next; when all fail the caller's load fails.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from scd_serve.codec.rebuild import begin, checked_layer, codes_from, decodes_from
from scd_serve.config.connector import ConnectorConfig
from scd_serve.decode.consumer_codecs import ConsumerCodecs
from scd_serve.decode.peers import compat_problems
from scd_serve.decode.receive import check_header, drain, receive
from scd_serve.errors import IncompatiblePeer, Overloaded, ScdError, TransferFailed, TransferTimedOut, Unavailable
from scd_serve.transport.channel import make_stream_channel
from scd_serve.transport.chunking import StreamVerifier
from scd_serve.transport.client import REQUEST_ID_KEY
from scd_serve.transport.proto import pb, pb_grpc
from scd_serve.transport.security import auth_metadata
from scd_serve.transport.status import from_rpc_error

ABORT_TIMEOUT_S = 1.0
STALL_POLL_S = 0.1
SLOT_POLL_S = 0.05  # a busy worker's slots are checked this often
HANDSHAKE_RETRY_S = 2.0  # a worker that failed its handshake is asked again after this long

# (layer, k, v): rows start.. of one layer, k after the consumer's RoPE; [rows, kv_heads, head_dim]
WriteLayer = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass
class Fetched:
    prefill: str  # the worker that served it
    payload_bytes: int
    rows: int  # K/V rows written per layer
    seconds: float


class _Worker:
    """One prefill worker: a blocking stream channel and its handshake."""

    def __init__(self, address: str, config: ConnectorConfig):
        self.address = address
        self.channel = make_stream_channel(address, config.transport)
        self.stub = pb_grpc.PrefillServiceStub(self.channel)
        self.metadata = auth_metadata(config.transport)
        self.info = None  # InfoReply once compatible
        self.problem = "not handshaken yet"
        self.slots = threading.BoundedSemaphore(1)  # its max_concurrent, once handshaken
        self.retry_at = 0.0  # time.monotonic() before which a failed handshake is not retried


class CodeSource:
    def __init__(self, config: ConnectorConfig, runtime):
        self.config, self.rt = config, runtime
        self.codecs = ConsumerCodecs(runtime, config.codebook)
        self.workers = [_Worker(a, config) for a in config.prefill]
        self._next = itertools.count()  # round-robin start, so prompts spread over the workers
        self._lock = threading.Lock()

    def handshake(self, worker: _Worker) -> str:
        """'' when `worker` serves this consumer the method, else why not (kept on the worker)."""
        t = self.config.transport
        if time.monotonic() < worker.retry_at:  # failed lately: not asked again (and waited for) per prompt
            return worker.problem
        try:
            info = worker.stub.Info(pb.InfoRequest(), timeout=t.rpc_timeout_s, metadata=worker.metadata)
        except grpc.RpcError as exc:
            info, problems = None, [f"unreachable ({exc.code().name}: {exc.details()})"]
        else:
            problems = compat_problems(info, self.rt.spec, self.config.method, self.codecs)
        worker.info, worker.problem = (None, "; ".join(problems)) if problems else (info, "")
        if worker.info is not None:  # at most as many transfers in flight as it runs at once
            worker.slots = threading.BoundedSemaphore(info.max_concurrent or 1024)
        else:
            worker.retry_at = time.monotonic() + HANDSHAKE_RETRY_S
        return worker.problem

    def fetch(self, request_id: str, tokens: list[int], start: int, write: WriteLayer,
              deadline: float | None = None, cancel: threading.Event | None = None) -> Fetched:
        """K/V of `tokens`' positions start..len-1 into `write`, every layer; raises ScdError when
        no worker delivers it by `deadline` (time.monotonic(); default: prefill_timeout_s). Each
        worker is tried once; one that is busy (its max_concurrent transfers in flight, or it
        answers "full": other consumers share it) is waited for until the deadline. Setting
        `cancel` (the request ended) stops the transfer and fails the fetch."""
        if not 0 <= start < len(tokens):
            raise ValueError(f"rows from {start} of a {len(tokens)}-token prompt")
        deadline = deadline or time.monotonic() + self.config.transport.prefill_timeout_s
        first = next(self._next) % len(self.workers)
        untried = self.workers[first:] + self.workers[:first]
        errors: list[str] = []
        while untried:
            for worker in list(untried):
                if cancel is not None and cancel.is_set():
                    raise TransferFailed(f"request {request_id} ended: its load was cancelled")
                with self._lock:
                    why = self.handshake(worker) if worker.info is None else ""
                if why:
                    errors.append(f"{worker.address}: {why}")
                    untried.remove(worker)
                    continue
                slots = worker.slots
                if not slots.acquire(blocking=False):
                    continue  # busy: try the others, then wait
                try:
                    return self._fetch_from(worker, request_id, tokens, start, write, deadline, cancel)
                except Overloaded:
                    continue
                except ScdError as err:
                    untried.remove(worker)
                    errors.append(f"{worker.address}: {err.kind}: {err.message}")
                    if isinstance(err, IncompatiblePeer):
                        worker.info, worker.problem = None, err.message
                finally:
                    slots.release()
            if untried and time.monotonic() + SLOT_POLL_S >= deadline:
                errors.append(f"waited until the deadline for a free slot on {', '.join(w.address for w in untried)}")
                break
            if untried:
                time.sleep(SLOT_POLL_S)
        raise Unavailable(f"no prefill worker delivered the K/V of request {request_id}: " + "; ".join(errors))

    def _fetch_from(self, worker: _Worker, request_id: str, tokens: list[int], start: int,
                    write: WriteLayer, deadline: float, cancel: threading.Event | None) -> Fetched:
        t0 = time.monotonic()
        codec = self.codecs.get(worker.info, self.config.method)
        ship_from = decodes_from(codec, start)  # a run's rows do not decode alone: it is sent them all
        first = codes_from(codec, ship_from, len(tokens))  # after the head, which is computed here
        rid = f"{request_id[:90]}-{uuid.uuid4().hex[:12]}"  # unique per attempt: a retry is a new transfer
        request = pb.PrefillRequest(request_id=rid, token_ids=tokens, method=self.config.method, start=first,
                                    consumer_fingerprint=self.rt.fingerprint,
                                    timeout_ms=max(1, int((deadline - t0) * 1e3)))
        rebuild = begin(codec, tokens, self.rt, ship_from)
        positions = torch.arange(start, len(tokens), device=self.rt.device)
        skip = start - ship_from

        def rebuild_layer(layer: int, code: dict) -> None:
            k_pre, v = checked_layer(rebuild, layer, code, skip)
            write(layer, self.rt.rotate_keys(k_pre, positions), v)

        verifier = StreamVerifier(rid, self.config.method, len(tokens) - first, self.rt.spec.num_layers,
                                  check_header=lambda header: check_header(header, worker, codec))
        call = worker.stub.Prefill(request, timeout=max(0.001, deadline - t0),
                                   metadata=(*worker.metadata, (REQUEST_ID_KEY, rid)))
        watch = _StallWatch(call, self.config.transport.stall_timeout_s, cancel)
        ok = False
        try:
            with torch.inference_mode():
                got = receive(watch.heard(call), verifier, rebuild.prepare, rebuild_layer)
            ok = True
        except grpc.RpcError as exc:
            if cancel is not None and cancel.is_set():
                raise TransferFailed(f"request {request_id} ended: its load was cancelled") from None
            if watch.stalled:
                raise TransferTimedOut(f"prefill worker {worker.address} sent nothing for "
                                       f"{self.config.transport.stall_timeout_s:g} s (stall_timeout_s)") from None
            raise from_rpc_error(exc, worker.address) from None
        finally:
            watch.stop()
            if not ok:
                call.cancel()
                self._abort(worker, rid)
        drain(call)
        return Fetched(worker.address, got.payload_bytes, len(tokens) - start, time.monotonic() - t0)

    def _abort(self, worker: _Worker, rid: str) -> None:
        """Tell the worker we walked away (its lease would free the transfer anyway)."""
        try:
            worker.stub.Abort(pb.AbortRequest(request_id=rid, reason="vLLM consumer stopped reading"),
                              timeout=ABORT_TIMEOUT_S, metadata=worker.metadata)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        for worker in self.workers:
            worker.channel.close()


class _StallWatch:
    """Cancels a stream that has been silent for `stall_s` (the first message included), or
    once `cancel` is set."""

    def __init__(self, call, stall_s: float, cancel: threading.Event | None = None):
        self.call, self.stall_s, self.cancel = call, stall_s, cancel
        self.last = time.monotonic()
        self.stalled = False
        self._done = threading.Event()
        threading.Thread(target=self._run, name="scd-stall-watch", daemon=True).start()

    def heard(self, messages):
        for msg in messages:
            self.last = time.monotonic()
            yield msg
            self.last = time.monotonic()  # the rebuild between messages is ours, not the worker's silence

    def _run(self) -> None:
        while not self._done.wait(STALL_POLL_S):
            if self.cancel is not None and self.cancel.is_set():
                self.call.cancel()
                return
            if time.monotonic() - self.last >= self.stall_s:
                self.stalled = True
                self.call.cancel()
                return

    def stop(self) -> None:
        self._done.set()
