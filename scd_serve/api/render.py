"""Render: engine outcomes and events -> OpenAI choices, whole or as stream chunks.

Echo, max_tokens 0 (log-likelihood requests), logprobs in either of OpenAI's shapes, and a
chat's tool calls (a ToolPlan's parser per choice: `message.tool_calls`, or `delta.tool_calls`
chunks as they are parsed; api/tool_calls.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from scd_serve.api.choices import Outcome, best, merged
from scd_serve.api.logprobs import TokenText, chat_logprobs, completion_logprobs, merge_completion, prompt_logprobs
from scd_serve.api.sampling import Plan
from scd_serve.api.sse import Shape
from scd_serve.api.tools import ToolPlan
from scd_serve.engine.request import TokenEvent, Usage


class Render:
    """Outcomes and events -> OpenAI choices: echo, max_tokens 0, logprobs in either shape."""

    def __init__(self, shape: Shape, plan: Plan, prompts: list[tuple[str | None, list[int]]], tokenizer,
                 as_ids: bool, tools: ToolPlan | None = None):
        self.shape, self.plan, self.prompts, self.tokenizer = shape, plan, prompts, tokenizer
        self.text = TokenText(tokenizer, as_ids)
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self._echo: dict[int, str] = {}

    def echo_text(self, p: int) -> str:
        if p not in self._echo:
            text, ids = self.prompts[p]
            self._echo[p] = text if text is not None else self.tokenizer.decode(ids)
        return self._echo[p]

    def whole(self, outcomes: list[Outcome]) -> dict:
        choices = []
        for i, o in enumerate(outcomes):
            text, logprobs, _ = self._piece(o.prompt_index, o.token_ids, o.records, o.prompt_records, o.text,
                                            echo=self.plan.echo, offset=0)
            finish, stop = (o.finish_reason, o.stop_reason) if self.plan.generate else ("length", None)
            message = None
            if self.tools is not None:
                parser = self.tools.parser()
                parser.feed(text)
                parser.end()
                message = {"role": "assistant", "content": parser.content} | (
                    {"tool_calls": parser.calls} if parser.calls else {})
                finish = self.tools.finish_reason(finish, parser)
            choices.append(self.shape.choice(i, text, finish, stop, logprobs, message=message))
            if self.plan.prompt_logprobs is not None and not self.shape.chat:  # vLLM: per choice
                choices[-1]["prompt_logprobs"] = self._prompt_logprobs(o)
        out = self.shape.whole(choices, self._usage(outcomes).to_dict())
        if self.plan.prompt_logprobs is not None and self.shape.chat:  # vLLM: beside the choices (one prompt)
            out["prompt_logprobs"] = self._prompt_logprobs(outcomes[0])
        return out

    def _prompt_logprobs(self, o: Outcome) -> list:
        ids = self.prompts[o.prompt_index][1]
        return prompt_logprobs(ids, o.prompt_records or [None] * len(ids), self.text, self.plan.prompt_logprobs)

    async def stream(self, firsts: list[TokenEvent], streams: list) -> AsyncIterator[dict]:
        outcomes = self.outcomes = [Outcome(k // self.plan.best_of) for k in range(len(streams))]
        parsers = [self.tools.parser() for _ in streams] if self.tools is not None else None
        offsets, made = [0] * len(streams), [0] * len(streams)

        def usage(i: int) -> dict:  # choice i's so far (continuous_usage_stats)
            return Usage(len(self.prompts[outcomes[i].prompt_index][1]), made[i]).to_dict()

        events = merged(firsts, streams)
        try:
            if self.shape.chat:
                for i in range(len(streams)):
                    yield self.shape.chunk(i, None, role=True, usage=usage(i))
            async for i, ev in events:
                o = outcomes[i]
                first = not o.parts
                o.add(ev)
                if self.plan.generate:  # (max_tokens 0: the one token made is dropped, not counted)
                    made[i] = o.usage.completion_tokens if o.usage else made[i] + (ev.token_id is not None)
                ids, recs = ([ev.token_id], [ev.logprob]) if ev.token_id is not None else ([], [])
                text, logprobs, offsets[i] = self._piece(o.prompt_index, ids, recs, ev.prompt_logprobs,
                                                         ev.text_delta, echo=self.plan.echo and first,
                                                         offset=offsets[i])
                finish, stop = ev.finish_reason, ev.stop_reason
                if finish is not None and not self.plan.generate:
                    finish, stop = "length", None
                if parsers is not None:
                    deltas = parsers[i].feed(text) + (parsers[i].end() if finish else [])
                    finish = self.tools.finish_reason(finish, parsers[i])
                    if not deltas and (logprobs or finish):
                        deltas = [{}]
                    for j, delta in enumerate(deltas):
                        last = j == len(deltas) - 1
                        yield self.shape.chunk(i, None, finish if last else None, stop, logprobs if last else None,
                                               delta=delta, usage=usage(i))
                elif text or logprobs or finish:
                    yield self.shape.chunk(i, text, finish, stop, logprobs, usage=usage(i))
            if self.shape.include_usage:
                yield self.shape.usage_chunk(self._usage(outcomes).to_dict())
        finally:
            await events.aclose()
            await close_all(streams)

    def _piece(self, p: int, ids, records, prompt_records, generated: str, *, echo: bool, offset: int):
        """-> (text, logprobs or None, the next text offset) of a choice or one stream chunk."""
        text, lp = "", None
        want = self.plan.logprobs is not None
        if echo:
            text = self.echo_text(p)
            if want and not self.shape.chat:
                lp = completion_logprobs(self.prompts[p][1], prompt_records or [None] * len(self.prompts[p][1]),
                                         self.text, offset, k=self.plan.logprobs)
            offset += len(text)
        if self.plan.generate:
            text += generated
            if want and self.shape.chat:
                lp = chat_logprobs(ids, records, self.text) if ids else None
            elif want:
                part = completion_logprobs(ids, records, self.text, offset)
                lp = merge_completion(lp, part) if ids else lp
                offset += sum(len(t) for t in part["tokens"])
        return text, lp, offset

    def summary(self) -> dict:
        """A streamed response's usage and finish reasons, once it ended (the usage trailer)."""
        done = best(self.outcomes, self.plan.n, self.plan.best_of)
        return self._usage(self.outcomes).to_dict() | {"finish_reasons": [o.finish_reason for o in done]}

    def _usage(self, outcomes: list[Outcome]) -> Usage:
        prompt = sum(len(ids) for _, ids in self.prompts)
        done = best(outcomes, self.plan.n, self.plan.best_of) if self.plan.best_of != self.plan.n else outcomes
        generated = sum(o.usage.completion_tokens for o in done if o.usage) if self.plan.generate else 0
        cached: dict[int, int] = {}  # per prompt: what every one of its choices found cached
        for o in outcomes:
            got = o.usage.cached_tokens if o.usage else 0
            cached[o.prompt_index] = min(cached.get(o.prompt_index, got), got)
        return Usage(prompt, generated, sum(cached.values()))


async def close_all(streams: list[AsyncIterator]) -> None:
    for s in streams:
        await s.aclose()
