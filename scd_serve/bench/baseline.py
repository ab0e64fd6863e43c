"""The baseline server for `bench serve`: one transformers `generate` call at a time.

It speaks the same streamed /v1/completions as the real API (enough of it for the load
generator), so the same Poisson load can be pointed at both. Requests queue FIFO and a
single worker thread runs `model.generate` for one request after another: this is what
serving looks like without continuous batching.

    python -m scd_serve.bench.baseline --model DIR --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


class _Streamer:
    """transformers streamer: the first put() is the prompt, every later one is new tokens."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out: asyncio.Queue):
        self.loop, self.out, self._prompt_seen = loop, out, False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for tok in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.out.put_nowait, int(tok))

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, None)


def create_app(model_dir: str, threads: int | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    jobs: queue.Queue = queue.Queue()

    def worker() -> None:  # the one place generate runs: strictly sequential
        while True:
            ids, max_tokens, streamer = jobs.get()
            try:
                with torch.inference_mode():
                    model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                   streamer=streamer, pad_token_id=0)
            except Exception:  # a failed request must not kill the worker
                pass
            finally:
                streamer.end()

    threading.Thread(target=worker, daemon=True, name="generate").start()
    app = FastAPI(title="sequential generate baseline")

    @app.get("/ready")
    async def ready():
        return {"ready": True}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body.get("prompt")
        ids = prompt if isinstance(prompt, list) else tokenizer(str(prompt or ""))["input_ids"]
        max_tokens = int(body.get("max_tokens") or 16)
        if not ids or max_tokens < 1:
            return JSONResponse({"error": {"type": "invalid_request_error", "message": "empty prompt"}}, 400)
        out: asyncio.Queue = asyncio.Queue()
        jobs.put((ids, max_tokens, _Streamer(asyncio.get_running_loop(), out)))
        created, rid = int(time.time()), f"base-{id(out):x}"

        async def events():
            n = 0
            while (tok := await out.get()) is not None:
                n += 1
                text = tokenizer.decode([tok])
                yield f"data: {json.dumps({'id': rid, 'object': 'text_completion', 'created': created, 'choices': [{'index': 0, 'text': text, 'finish_reason': None}]})}\n\n"
            final = {"id": rid, "object": "text_completion", "created": created,
                     "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": len(ids), "completion_tokens": n}}
            yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--threads", type=int)
    a = p.parse_args()
    import uvicorn

    uvicorn.run(create_app(a.model, a.threads), host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
