"""Process lifecycle shared by the worker commands: logging, stop signals, supervised tasks, addresses, exit."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from contextlib import suppress
from typing import Any, NoReturn

from scd_serve.config.address import join_host_port
from scd_serve.config.control import control_config_from_args
from scd_serve.config.model import DTYPE_CHOICES
from scd_serve.control.allocator import log_allocator


def setup_logging(role: str) -> None:
    level = os.environ.get("SCD_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request is noise


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call inside the running loop)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event


def add_worker_arguments(parser, *, model: str, model_help: str, codebook: str, listener: str, port: int,
                         dialer: str) -> None:
    """The flags every worker role shares (the compose and k8s files use these names)."""
    parser.add_argument("--model", default=model, help=model_help)
    # None = not chosen: the built-in default, which may not fit --model (then: codebook-free methods,
    # with a warning); a chosen codebook made for other models is refused at start
    parser.add_argument("--codebook", default=None,
                        help=f"SCD codebook directory, '' for none (default: {codebook} where it fits --model)")
    parser.add_argument("--host", default="127.0.0.1", help=f"{listener} listen address")
    parser.add_argument("--port", type=int, default=port, help=f"{listener} port (0 = any free port)")
    parser.add_argument("--control-url", default="", help="registry to join, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--advertise", default="", help=f"HOST:PORT {dialer} dial (default host:port)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="weights and KV pool dtype (auto: bfloat16 on CUDA, float32 on the CPU; bfloat16 on a CPU "
                             "with AMX or AVX512-BF16 is ~3x faster, but SCD rebuilds from a float32-calibrated "
                             "codebook worse there: docs/benchmarks.md)")


async def cancel_all(*tasks: asyncio.Future) -> None:
    """Cancel the tasks and wait until each has unwound (their outcomes are dropped)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def detach(coro: Coroutine[Any, Any, Any], tasks: set[asyncio.Task]) -> None:
    """Run `coro` as a task held in `tasks` (for cancel_all at close) until it ends. Its failure
    is expected once its request is gone: marked seen (asyncio would log it at ERROR)."""
    task = asyncio.ensure_future(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def supervise(task: asyncio.Task, on_death: Callable[[BaseException], None] | None = None) -> asyncio.Task:
    """Watch a background task that should run until cancelled: if it ends with an exception,
    log it with its traceback and call on_death(exc) (the owner turns not ready, or restarts it).
    A task that dies silently would leave a worker serving on stale state."""
    def done(t: asyncio.Task) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        if exc is None:
            exc = RuntimeError(f"background task {t.get_name()} returned; it should run until cancelled")
        logging.getLogger("scd_serve").error("background task %s died: %s: %s", t.get_name(), type(exc).__name__,
                                             exc, exc_info=exc)
        if on_death is not None:
            on_death(exc)
    task.add_done_callback(done)
    return task


class Restarting:
    """A background coroutine kept running until stop(): when it dies it is logged (supervise)
    and started again after `delay_s`. `make()` is called for every start."""

    def __init__(self, make: Callable[[], Coroutine[Any, Any, Any]], name: str, delay_s: float = 0.5):
        self.make, self.name, self.delay_s = make, name, delay_s
        self.task: asyncio.Task | None = None
        self.num_restarts = 0
        self._stopped = False

    def start(self) -> None:
        if not self._stopped:
            self.task = supervise(asyncio.create_task(self.make(), name=self.name), self._died)

    def _died(self, exc: BaseException) -> None:
        if not self._stopped:
            self.num_restarts += 1
            asyncio.get_running_loop().call_later(self.delay_s, self.start)

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()

    async def stop(self) -> None:
        self._stopped = True
        if self.task is not None:
            await cancel_all(self.task)


def advertised(advertise: str, host: str, port: int) -> str:
    """The address peers should dial: --advertise, else host:port (0.0.0.0 -> 127.0.0.1)."""
    if advertise:
        return advertise
    return join_host_port("127.0.0.1" if host in ("0.0.0.0", "::", "") else host, port)


async def start_http(server) -> tuple[asyncio.Task, int]:
    """Run a uvicorn.Server in a task, our stop event owning SIGINT/SIGTERM; once it listens ->
    (the task, its port: the OS's pick for port 0)."""
    from scd_serve.errors import ConfigError

    server.install_signal_handlers = lambda: None

    async def serve() -> None:
        with suppress(SystemExit):  # uvicorn's answer to a failed bind (it logged the cause): reported below
            await server.serve()

    http = asyncio.create_task(serve())
    while not server.started and not http.done():
        await asyncio.sleep(0.02)
    if http.done() or not server.servers or not server.servers[0].sockets:
        raise ConfigError(f"HTTP listener on {server.config.host}:{server.config.port} did not start "
                          f"(port in use or shutting down)")
    return http, server.servers[0].sockets[0].getsockname()[1]


def freeze_heap() -> None:
    """After start-up: the objects made so far (a model's modules, imports, the warm-up's) are
    kept out of every later garbage collection. A serving process holds ~265k of them, and a
    full collection over them paused a decode worker for 0.15 s, inside a request's time to first
    token, about once in ten 1k-token transfers (vLLM freezes its start-up objects likewise)."""
    gc.collect()
    gc.freeze()


def run_role(role: str, args, config_from_args, check_exposure, serve) -> NoReturn:
    """A serving role's `run`: logging, its settings and the control plane's from the flags, the
    exposure check, then serve(config, control) until stopped; exit 1 if it returned True (died)."""
    setup_logging(role)
    log_allocator(role)
    config, control = config_from_args(args), control_config_from_args(args)
    check_exposure(config, control, args.insecure)
    exit_now(1 if asyncio.run(serve(config, control)) else 0)


def exit_now(code: int = 0) -> NoReturn:
    """End the process right after a clean shutdown. Everything is closed by now; the
    interpreter's own teardown (torch, grpc and executor threads) can take seconds on a
    loaded machine, which would overrun the grace period supervisors give after SIGTERM."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
