"""Fan-out: one OpenAI request -> several engine requests (a list of prompts, `n`, `best_of`),
and their events back, as whole choices or one merged stream.

With best_of > n the n with the highest cumulative log-probability are kept (vLLM's rule;
whole responses only). A failure of any engine request fails the whole response: the
others are cancelled (engine requests aborted, blocks freed) before the error is answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from scd_serve.control.lifecycle import cancel_all
from scd_serve.engine.request import MAX_SEED, TokenEvent, TokenLogprob, Usage
from scd_serve.errors import ScdError

T = TypeVar("T")


def child_seed(seed: int | None, k: int) -> int | None:
    """Choice k of a seeded request draws from seed + k (vLLM's rule), so choices differ but repeat."""
    return None if seed is None else (seed + k) % (MAX_SEED + 1)


@dataclass
class Outcome:
    """One engine request's events, accumulated into a choice."""

    prompt_index: int
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    records: list[TokenLogprob | None] = field(default_factory=list)
    prompt_records: tuple[TokenLogprob | None, ...] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None

    def add(self, event: TokenEvent) -> None:
        self.parts.append(event.text_delta)
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
            self.records.append(event.logprob)
        if event.prompt_logprobs is not None:
            self.prompt_records = event.prompt_logprobs
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.usage = event.finish_reason, event.stop_reason, event.usage

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def cumulative_logprob(self) -> float:
        return sum(r.logprob for r in self.records if r is not None)


def best(outcomes: list[Outcome], n: int, best_of: int) -> list[Outcome]:
    """Per prompt (best_of consecutive outcomes), the n to return, best first when ranked."""
    if best_of == n:
        return outcomes
    return [o for start in range(0, len(outcomes), best_of)
            for o in sorted(outcomes[start:start + best_of], key=lambda x: x.cumulative_logprob,
                            reverse=True)[:n]]


async def all_or_none(works: list[Awaitable[T]]) -> list[T]:
    """Every result, or the first exception after the rest were cancelled (and have unwound)."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await cancel_all(*tasks)


async def first_event(events: AsyncIterator[TokenEvent]) -> TokenEvent:
    try:
        return await anext(events)
    except StopAsyncIteration:
        raise ScdError("the backend ended the request without a result") from None


async def rest(first: TokenEvent, events: AsyncIterator[TokenEvent], outcome: Outcome) -> Outcome:
    outcome.add(first)
    event = first
    while event.finish_reason is None:
        event = await anext(events)
        outcome.add(event)
    return outcome


async def merged(firsts: list[TokenEvent], streams: list[AsyncIterator[TokenEvent]]
                 ) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(choice, event) from every stream as they come; the first events (already pulled) first."""
    for i, event in enumerate(firsts):
        yield i, event
    live = [i for i, event in enumerate(firsts) if event.finish_reason is None]
    if len(streams) == 1:  # the common case: no tasks, the client's cancellation reaches the engine directly
        if live:
            async for event in streams[0]:
                yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for event in streams[i]:
                queue.put_nowait((i, event))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in live]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        await cancel_all(*tasks)
