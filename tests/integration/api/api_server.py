"""Helpers for API integration tests: a real uvicorn server in a thread, engine-backed apps."""

import asyncio
import threading
import time

import uvicorn

from scd_serve.api.app import create_app
from scd_serve.api.backend import EngineBackend
from scd_serve.config.api import ApiConfig
from scd_serve.config.engine import EngineConfig
from scd_serve.engine.engine import Engine


def engine_app(runtime, engine_kw=None, api_kw=None):
    """(app, engine): a started engine on `runtime` behind create_app."""
    ekw = dict(num_blocks=128, block_size=8, max_model_len=256, max_num_seqs=8, max_concurrent=16,
               max_prefill_tokens=64, idle_poll_s=0.01) | (engine_kw or {})
    engine = Engine(runtime, EngineConfig(**ekw))
    engine.start()
    akw = dict(max_model_len=ekw["max_model_len"], max_tokens_cap=128) | (api_kw or {})
    return create_app(ApiConfig(**akw), EngineBackend(engine, "tiny-llama")), engine


def stop_engine(engine):
    asyncio.run(engine.stop(1))


class ServerThread:
    """uvicorn on 127.0.0.1, port chosen by the OS; `url` once started."""

    def __init__(self, app, timeout_keep_alive=5):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                timeout_keep_alive=timeout_keep_alive)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self):
        self.thread.start()
        end = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > end or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
