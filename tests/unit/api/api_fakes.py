"""FakeBackend: a canned reply in microseconds, with fault hooks, for API tests."""

import asyncio

from scd_serve.engine.request import TokenEvent, Usage
from scd_serve.testing.fake_runtime import byte_tokenizer


class FakeBackend:
    model_name = "fake-model"

    def __init__(self, reply="Hello, world!", delay=0.0, error=None, error_after=None):
        self.tokenizer = byte_tokenizer()
        self.vocab_size = len(self.tokenizer)
        self.reply = reply
        self.delay = delay
        self.error = error  # raised before the first token
        self.error_after = error_after  # (n, exc): raised after n tokens
        self.is_ready = True  # the engine works
        self.peers_ready = True
        self.calls = []
        self.active = 0
        self.tokens_sent = 0

    def ready(self):
        return self.is_ready and self.peers_ready

    def engine_ready(self):
        return self.is_ready

    def ready_detail(self):
        return {}

    def stats(self):
        return {"num_running": self.active, "num_waiting": 0, "num_free_blocks": 10, "num_total_blocks": 10}

    async def generate(self, req):
        self.calls.append(req)
        if self.error is not None:
            raise self.error
        self.active += 1
        try:
            ids = self.tokenizer.encode(self.reply)[: req.params.max_tokens]
            for i, t in enumerate(ids):
                if self.error_after and i == self.error_after[0]:
                    raise self.error_after[1]
                await asyncio.sleep(self.delay)
                self.tokens_sent += 1
                last = i == len(ids) - 1
                yield TokenEvent(t, self.tokenizer.decode([t]), "length" if last else None,
                                 Usage(len(req.prompt_token_ids), i + 1) if last else None)
        finally:
            self.active -= 1
