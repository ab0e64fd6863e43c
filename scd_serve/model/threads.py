"""Which threads run torch's CPU ops with every thread, and which with one.

torch's CPU ops run on libgomp's OpenMP: a thread's first parallel region gives it a team of
OMP_NUM_THREADS - 1 workers of its own, kept until that thread exits. Between regions the
workers spin a while before they sleep, unless libgomp then manages more threads than the
machine has CPUs: they sleep at once, and each of the thousands of regions of a forward waits
for a futex to wake them. A server whose main thread loaded the model (one team) and whose
engine thread runs the forward (another) is in that case. Measured at the Qwen2.5-0.5B shape
(random weights, bfloat16, two threads on two cores), a 1,024-token prefill in a second thread
took 1.32-1.45 s with the load done on the main thread, 1.00 s with the load done in a thread
that had exited (docs/benchmarks.md).

So a worker loads its model in a thread that then exits (`in_passing_thread`), its main thread
runs torch ops on one thread (`one_thread`: a region of one thread makes no team), the thread
that runs the forward (the engine's loop, the producer's) uses every thread, and the threads
beside it that touch tensors (transfers writing a layer) use one.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger("scd_serve.model")


def in_passing_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) in a thread that exits after it, so that the team its torch ops
    made goes with it. Blocks until done; fn's exception is raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="scd-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def one_thread() -> bool:
    """The calling thread's torch ops on one thread from now on; other threads keep theirs
    (torch.set_num_threads would change the count every new thread starts with). -> whether it
    could: False where torch's OpenMP runtime is not found (then nothing changes)."""
    setter = _omp_set_num_threads()
    if setter is None:
        return False
    torch.get_num_threads()  # torch sets a thread's count at its first parallel op: let it first
    setter(1)
    return True


def _omp_set_num_threads() -> Callable[[int], None] | None:
    try:
        return ctypes.CDLL(None).omp_set_num_threads  # libgomp, loaded with torch's libraries
    except (AttributeError, OSError):
        return None


def load_for_serving(model: str, device: Any, dtype: Any) -> Any:
    """A serving role's ModelRuntime, its linears packed, loaded in a passing thread; the calling
    (main) thread runs torch ops on one thread from then on."""
    from scd_serve.model import cpu_kernel
    from scd_serve.model.runtime import ModelRuntime

    def load() -> ModelRuntime:
        rt = ModelRuntime.load(model, device=device, dtype=dtype)
        if rt.pack_linears():
            log.info("linear weights packed for oneDNN (%s)", rt.dtype)
        if rt.device.type == "cpu":
            cpu_kernel.start()  # built in the background; the torch path serves until then
        return rt

    one_thread()
    return in_passing_thread(load)
