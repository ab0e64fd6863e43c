"""The memory allocator a worker's process runs on: tcmalloc where the machine has it.

A decode step frees and asks again for the same large blocks (gathered keys and values, logits,
MLP activations) every step; glibc's malloc hands blocks that large back to the system and
page-faults them in again, in every thread's arena. tcmalloc keeps them: in process, 16 streams
at the 0.5B shape ran 8-10% more tokens a second (docs/benchmarks.md, "The allocator"). vLLM's
CPU build preloads it too. An allocator can only be chosen before the process starts, so the
worker commands (`prefill`, `decode`) on the CPU re-execute themselves once, with it in
LD_PRELOAD (a GPU worker's tensors are not the host allocator's: it runs as it is).

SCD_ALLOCATOR: `auto` (default: tcmalloc where found, else the system's), `system`, or a path
to an allocator's shared library.
"""

from __future__ import annotations

import ctypes.util
import glob
import logging
import os
import sys

from scd_serve.errors import ConfigError

ENV = "SCD_ALLOCATOR"
DONE = "SCD_ALLOCATOR_CHOSEN"  # set before the re-exec: a process chooses once, whatever the outcome
WORKER_COMMANDS = ("prefill", "decode")
SEARCH = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib64", "/lib")
# tcmalloc reports every allocation over 1 GiB on stderr by default; a model load may make several
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


def find_tcmalloc() -> str:
    """The path of tcmalloc's shared library on this machine, or ""."""
    for folder in SEARCH:
        for pattern in ("libtcmalloc_minimal.so*", "libtcmalloc.so*"):
            if found := sorted(glob.glob(os.path.join(folder, pattern))):
                return found[0]
    name = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    return name or ""


def wanted(environ) -> str:
    """The library SCD_ALLOCATOR asks for ("" for the system's allocator)."""
    choice = environ.get(ENV, "auto").strip() or "auto"
    if choice == "system":
        return ""
    if choice == "auto":
        return find_tcmalloc()
    if not os.path.isfile(choice):
        raise ConfigError(f"{ENV}={choice!r}: not a file; use auto, system, or the path of an allocator's .so")
    return choice


def preload_with(library: str, preload: str) -> str:
    """LD_PRELOAD's value with `library` first; as it is where a library of that name is in it."""
    if os.path.basename(library).split(".")[0] in preload:
        return preload
    return f"{library}:{preload}" if preload else library


def device_of(argv: list[str], environ) -> str:
    """The --device a worker's command line (or SCD_DEVICE) names; workers default to the CPU."""
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return environ.get("SCD_DEVICE", "cpu")


def reexec_with_allocator(command: str, argv: list[str], environ=os.environ) -> None:
    """For a worker command run from the command line (argv: its arguments): re-execute this
    process (same pid, argv and interpreter options) with the chosen allocator preloaded; returns
    where there is nothing to do (another command, a GPU worker, whose tensors the allocator does
    not hold, the choice made already, the system's allocator)."""
    if (command not in WORKER_COMMANDS or environ.get(DONE) or not sys.platform.startswith("linux")
            or not device_of(argv, environ).startswith("cpu")):
        return
    library = wanted(environ)
    preload = environ.get("LD_PRELOAD", "")
    environ[DONE] = library or "system"
    updated = preload_with(library, preload) if library else preload
    if updated == preload:
        return
    environ["LD_PRELOAD"] = updated
    for name, value in QUIET.items():
        environ.setdefault(name, value)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def loaded() -> str:
    """The allocator this process runs on: the preloaded library's name, or "system"."""
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()
    except OSError:
        return "unknown"
    for name in ("tcmalloc", "jemalloc", "mimalloc"):
        if f"lib{name}" in text:
            return name
    return "system"


def log_allocator(role: str) -> None:
    logging.getLogger("scd_serve").info("%s: memory allocator %s (%s=%s)", role, loaded(), ENV,
                                        os.environ.get(ENV, "auto"))
