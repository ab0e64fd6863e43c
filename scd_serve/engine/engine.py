"""Engine: continuous batching in its own thread, an asyncio `generate` on the outside.

All scheduler and block-manager state is owned by the step-loop thread. The asyncio side
talks to it only through a thread-safe inbox (add, filled, fallback, abort), applied
between steps; the loop answers through each request's asyncio.Queue. Blocks are freed
on every path: finish, error, deadline, client gone (abort from `finally`), engine death.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import random
import threading
import time
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any

from scd_serve.config.engine import EngineConfig
from scd_serve.config.methods import LOCAL
from scd_serve.engine.block_manager import BlockManager
from scd_serve.engine.detokenizer import Detokenizer
from scd_serve.engine.fill import run_fill
from scd_serve.engine.generation_config import GenerationDefaults
from scd_serve.engine.grammar import GrammarCompiler
from scd_serve.engine.inbox import Abort, Add, Filled, FillFailed, Message
from scd_serve.engine.request import GenerationRequest, KVFill, TokenEvent, Usage
from scd_serve.engine.runner import Runner
from scd_serve.engine.sampler import Ended
from scd_serve.engine.runtime_protocol import Runtime
from scd_serve.engine.scheduler import ScheduledBatch, Scheduler
from scd_serve.engine.sequence import Sequence, cache_namespace
from scd_serve.engine.sink import LayerSink
from scd_serve.errors import (ConfigError, DeadlineExceeded, EngineDead, InvalidRequest, Overloaded, PromptTooLong,
                              ScdError, ShuttingDown, StepFailed)

log = logging.getLogger("scd_serve.engine")

_POLL_S = 0.25  # how often a waiting request re-checks engine death
MAX_FAILED_STEPS = 3  # consecutive failing steps before the loop gives up (the runtime is broken)


@dataclasses.dataclass
class BlocksReady:
    """First message to a filling request: its blocks are allocated; write through `sink`."""

    sink: LayerSink


@dataclasses.dataclass(eq=False)
class _Handle:
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    detok: Detokenizer
    sink: LayerSink | None = None


class Engine:
    def __init__(self, runtime: Runtime, config: EngineConfig):
        limit = getattr(runtime.spec, "max_position_embeddings", None)
        if limit is not None and config.max_model_len > limit:
            raise ConfigError(f"engine.max_model_len {config.max_model_len} exceeds the model's "
                              f"max_position_embeddings {limit}")
        self.config, self.runtime, self.tokenizer = config, runtime, runtime.tokenizer
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.prefix_caching)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.generation_defaults = GenerationDefaults.load(runtime.path)
        self.eos_token_ids = (frozenset([eos] if eos is not None else [])
                              | self.generation_defaults.stop_ids(self.tokenizer))
        # structured outputs: grammars over this vocabulary (the logits' width), compiled on demand
        self.grammars = GrammarCompiler(self.tokenizer, int(runtime.spec.vocab_size), self.eos_token_ids,
                                        json_whitespace=config.json_whitespace)
        self.scheduler = Scheduler(config, self.block_manager, self.eos_token_ids)
        self.runner = Runner(runtime, config, self.eos_token_ids)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._lock = threading.Lock()  # guards _handles (touched from any event loop)
        self._handles: dict[str, _Handle] = {}  # request_id -> handle, for admission
        self._live: dict[int, _Handle] = {}  # seq_id -> handle; loop thread only
        self._outbox: list[tuple[_Handle, Any]] = []  # loop thread only, flushed once per step
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._accepting = True
        self._beat = time.monotonic()
        self.num_generated_tokens = self.num_steps = self.num_fallbacks = 0
        self._failed_steps = 0  # consecutive steps that raised
        self._seeds = random.Random(config.seed) if config.seed is not None else None  # loop thread only

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="scd-engine", daemon=True)
        self._thread.start()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Drain: refuse new requests, let running ones finish within grace_s, end the rest
        with a `shutting_down` error, then stop the loop."""
        self._accepting = False
        await self._drained(max(0.0, grace_s))
        with self._lock:
            left = list(self._handles.values())
        for h in left:
            self._send(Abort(h, ShuttingDown("server shut down before the request finished")))
        await self._drained(2.0)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    def ready(self) -> bool:
        return (self._accepting and self.loop_alive()
                and time.monotonic() - self._beat < self.config.stall_timeout_s)

    def stats(self) -> dict[str, Any]:
        s, bm = self.scheduler, self.block_manager
        return {"num_running": len(s.running), "num_waiting": len(s.waiting), "num_filling": len(s.filling),
                "num_requests": self._num_handles(), "num_free_blocks": bm.num_free,
                "num_total_blocks": bm.num_blocks, "num_cached_blocks": bm.num_cached_blocks,
                "prefix_cache_queried_tokens": bm.num_queried_tokens, "prefix_cache_hit_tokens": bm.num_hit_tokens,
                "num_generated_tokens": self.num_generated_tokens,
                "num_steps": self.num_steps, "num_fallbacks": self.num_fallbacks,
                "num_steps_ahead": self.runner.num_steps_ahead,
                "num_last_rows": self.runner.num_last_rows, "ready": self.ready()}

    def cached_prefix(self, token_ids: list[int], method: str) -> int:
        """Prompt tokens a request by `method` (a fill's, or "local") would find in the prefix
        cache now. A peek from any thread: it reads dicts the loop writes, so the answer may be
        a step old, which a prediction can take."""
        fill = method != LOCAL
        return self.block_manager.cached_prefix(list(token_ids), cache_namespace(method, fill), fill)

    # ---------------------------------------------------------------- requests
    async def generate(self, req: GenerationRequest, kv_fill: KVFill | None = None) -> AsyncIterator[TokenEvent]:
        if self._dead is not None:
            raise EngineDead("the engine loop has stopped")
        if not self._accepting:
            raise ShuttingDown("server is shutting down")
        if not self.loop_alive():
            raise EngineDead("the engine loop is not running")
        n, max_tokens = req.num_prompt_tokens, req.params.max_tokens
        if n < 1:
            raise InvalidRequest("prompt is empty: it must contain at least one token", field="prompt")
        if n + max_tokens > self.config.max_model_len:
            raise PromptTooLong(f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} "
                                f"exceeds the maximum context length {self.config.max_model_len}", field="max_tokens")
        deadline = req.deadline if req.deadline is not None else time.monotonic() + self.config.request_timeout_s
        req = dataclasses.replace(req, deadline=deadline)
        # Prompt log-probabilities need the consumer's own forward pass over the prompt: a fill
        # (rebuilt K/V, no logits) would be wasted, so such a request is prefilled here.
        seq = Sequence(req, needs_fill=kv_fill is not None and n > 1 and req.params.prompt_logprobs is None)
        h = _Handle(seq, asyncio.get_running_loop(), asyncio.Queue(),
                    Detokenizer(self.tokenizer, req.prompt_token_ids, req.params.stop))
        with self._lock:
            if len(self._handles) >= self.config.max_concurrent:
                raise Overloaded(f"engine is at capacity ({self.config.max_concurrent} requests), retry later",
                                 retry_after_s=self.config.retry_after_s)
            if req.request_id in self._handles:
                raise InvalidRequest(f"request id {req.request_id!r} is already in flight", field="request_id")
            self._handles[req.request_id] = h
        log.debug("admitted request_id=%s prompt_tokens=%d max_tokens=%d method=%s",
                  req.request_id, n, max_tokens, req.method)
        try:
            self._send(Add(h))
            early: list = []  # events the engine sent while the fill was finishing
            if seq.needs_fill:
                ready = await self._next(h, deadline)
                failure, early = await run_fill(kv_fill, req, ready.sink, lambda: self._next(h, deadline))
                # (on success the sink has told the loop already, as the last layer landed)
                if failure is not None:
                    if not self.config.fallback_to_local or isinstance(failure, DeadlineExceeded):
                        raise failure
                    log.warning("request_id=%s KV fill failed (%s); prefilling locally", req.request_id, failure.kind)
                    self._send(FillFailed(h))
            while True:
                event = early.pop(0) if early else await self._next(h, deadline)
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self._send(Abort(h))  # no-op when already finished; frees blocks otherwise
            with self._lock:
                self._handles.pop(req.request_id, None)

    async def _next(self, h: _Handle, deadline: float) -> Any:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"request {h.seq.request.request_id} exceeded its deadline")
            try:
                item = await asyncio.wait_for(h.queue.get(), timeout=min(remaining, _POLL_S))
            except TimeoutError:
                if not self.loop_alive():  # died, or stopped without hearing of this request
                    raise EngineDead("the engine loop has stopped") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    # ---------------------------------------------------------------- helpers (any thread)
    def loop_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    async def _drained(self, within_s: float) -> None:
        end = time.monotonic() + within_s
        while self._num_handles() and time.monotonic() < end and self.loop_alive():
            await asyncio.sleep(0.02)

    def _num_handles(self) -> int:
        with self._lock:
            return len(self._handles)

    def _send(self, message: Message) -> None:
        self._inbox.put(message)
        self._wake.set()

    # ---------------------------------------------------------------- the step loop (its thread)
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._beat = time.monotonic()
                self._apply_inbox()
                self._expire(time.monotonic())
                batch = self.scheduler.schedule()
                for seq in batch.filling:
                    h = self._live[seq.seq_id]
                    # Filled straight from the writing thread, as the last layer lands
                    h.sink = self.runner.sink_for(seq, on_complete=lambda h=h: self._send(Filled(h)),
                                                  step_ahead=batch.step_ahead)
                    self._outbox.append((h, BlocksReady(h.sink)))
                if batch.is_empty:
                    self._flush()
                    if self._wake.wait(self.config.idle_poll_s):
                        self._wake.clear()
                    continue
                try:
                    sampled = self.runner.run(batch)
                except Exception as exc:  # noqa: BLE001 - this step's requests fail, the engine goes on
                    self._step_failed(batch, exc)
                    continue
                if self.runner.ran_forward:  # a step of first tokens made ahead says nothing of the forward
                    self._failed_steps = 0
                logprobs = {batch.decodes[i].seq_id: lp for i, lp in sampled.logprobs.items()}
                batch, tokens = self._drop_failed_rows(batch, sampled.rows)
                self.scheduler.postprocess(batch, tokens)
                for seq, token in zip(batch.decodes, tokens, strict=True):
                    self._emit_token(seq, token, logprobs.get(seq.seq_id))
                self.num_generated_tokens += len(tokens)
                self.num_steps += 1
                self._flush()
        except BaseException as exc:  # noqa: BLE001 - any other failure kills the loop; requests must hear of it
            self._die(exc)

    def _drop_failed_rows(self, batch: ScheduledBatch, results: list) -> tuple[ScheduledBatch, list[int]]:
        """End each sequence whose row could not be sampled (its StepFailed in `results`) or that
        ended without a token (Ended); -> the batch and tokens of the rest, which go on."""
        kept: list[tuple[Sequence, int]] = []
        for seq, result in zip(batch.decodes, results, strict=True):
            if isinstance(result, int):
                kept.append((seq, result))
                continue
            if isinstance(result, Ended):
                self._emit_end(seq)
                continue
            log.error("request_id=%s failed: %s", seq.request.request_id, result.message)
            self._end(self._live[seq.seq_id], "error", result)
        if len(kept) == len(results):
            return batch, results
        return dataclasses.replace(batch, decodes=[seq for seq, _ in kept]), [token for _, token in kept]

    def _step_failed(self, batch: ScheduledBatch, exc: Exception) -> None:
        """A step raised: its requests fail with StepFailed and free their blocks; the engine goes on.
        Steps that keep failing mean a broken runtime: the loop dies (/ready says so)."""
        self._failed_steps += 1
        log.error("engine step failed (%d in a row): %s: %s", self._failed_steps, type(exc).__name__, exc,
                  exc_info=exc)
        if self._failed_steps >= MAX_FAILED_STEPS:
            raise exc
        err = StepFailed(f"the engine step for this request failed: {type(exc).__name__}: {exc}")
        for seq in {id(s): s for s in [*batch.decodes, *(s for s, _ in batch.prefills)]}.values():
            self._end(self._live[seq.seq_id], "error", err)
        self._flush()

    def _apply_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            h = message.handle
            match message:
                case Add():
                    if self._seeds is not None and h.seq.seed is None:  # --seed: in arrival order
                        h.seq.seed = self._seeds.getrandbits(63)
                    self._live[h.seq.seq_id] = h
                    self.scheduler.add(h.seq)
                case Filled():
                    if h.sink is not None:
                        h.sink.close()  # every layer is in: a stray late write (an abandoned attempt) is refused
                    self.scheduler.fill_done(h.seq, None if h.sink is None else h.sink.num_tokens)
                case FillFailed():
                    if h.sink is not None:
                        h.sink.close()  # no late writes over the local prefill
                    if self.scheduler.fill_failed(h.seq):
                        self.num_fallbacks += 1
                case Abort(error=error):
                    self._end(h, "abort", error)

    def _expire(self, now: float) -> None:
        for seq, why in self.scheduler.expired(now):
            message = (f"request waited more than {self.config.queue_timeout_s:g} s for capacity (queue_timeout_s)"
                       if why == "queue_timeout" else f"request {seq.request.request_id} exceeded its deadline")
            self._end(self._live[seq.seq_id], why, DeadlineExceeded(message))

    def _end(self, h: _Handle, reason: str, error: ScdError | None) -> None:
        """Finish a sequence early (abort, deadline, shutdown) and free its blocks."""
        if h.sink is not None:
            h.sink.close()  # waits for a write in flight; later writes are refused
        self.runner.forget(h.seq)
        if self._live.pop(h.seq.seq_id, None) is None:
            return  # already finished, or never reached the loop
        self.scheduler.finish(h.seq, reason)
        if error is not None:
            self._outbox.append((h, error))
        log.debug("ended request_id=%s reason=%s output_tokens=%d", h.seq.request.request_id, reason,
                  h.seq.num_output_tokens)

    def _emit_token(self, seq: Sequence, token: int, logprob: Any = None) -> None:
        """logprob: the token's TokenLogprob where the request asked for log-probabilities."""
        h = self._live[seq.seq_id]
        params = seq.request.params
        delta = h.detok.add(token, check_stop=seq.num_output_tokens >= params.min_tokens)
        if h.detok.stopped and not seq.is_finished:
            self.scheduler.finish(seq, "stop")
            seq.stop_reason = h.detok.stop_reason
        extra: dict[str, Any] = {"logprob": logprob}
        if seq.prompt_logprobs is not None and seq.num_output_tokens == 1:
            extra["prompt_logprobs"] = tuple(seq.prompt_logprobs)
        if not seq.is_finished:
            self._outbox.append((h, TokenEvent(token, delta, **extra)))
            return
        delta += h.detok.flush()
        usage = Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_prefix_cached)
        self._outbox.append((h, TokenEvent(token, delta, seq.finish_reason, usage, stop_reason=seq.stop_reason,
                                           queue_s=seq.queue_s, **extra)))
        del self._live[seq.seq_id]
        log.debug("finished request_id=%s reason=%s output_tokens=%d", seq.request.request_id,
                  seq.finish_reason, seq.num_output_tokens)

    def _emit_end(self, seq: Sequence) -> None:
        """The sequence is done without a new token (its grammar is complete, no end token)."""
        h = self._live.pop(seq.seq_id)
        self.scheduler.finish(seq, "stop")
        usage = Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_prefix_cached)
        self._outbox.append((h, TokenEvent(None, h.detok.flush(), "stop", usage, queue_s=seq.queue_s)))

    def _flush(self) -> None:
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for h, item in self._outbox:
            by_loop.setdefault(h.loop, []).append((h.queue, item))
        self._outbox = []
        for loop, items in by_loop.items():
            with suppress(RuntimeError):  # that event loop is closed; its requests are gone
                loop.call_soon_threadsafe(_deliver, items)

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        log.error("engine loop died: %s: %s", type(exc).__name__, exc, exc_info=exc)
        err = EngineDead(f"the engine failed: {type(exc).__name__}")
        for h in list(self._live.values()):
            if h.sink is not None:
                h.sink.close()
            self._live.pop(h.seq.seq_id, None)
            try:
                self.scheduler.finish(h.seq, "error")
            except Exception:  # noqa: BLE001 - bookkeeping may be what broke; still tell everyone
                log.exception("could not release request_id=%s", h.seq.request.request_id)
            self._outbox.append((h, err))
        self._flush()


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)
