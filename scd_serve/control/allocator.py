"""The memory allocator a worker's process runs on: tcmalloc where the machine has it.

A decode step frees and asks again for the same large blocks (gathered keys and values, logits,
MLP activations) every step; glibc's malloc hands blocks that large back to the system and
page-faults them in again, in every thread's arena. tcmalloc keeps them: in process, 16 streams
at the 0.5B shape ran 8-10% more tokens a second (docs/benchmarks.md, "The allocator"). vLLM's
CPU build preloads it too. An allocator can only be chosen before the process starts, so the
worker commands (`prefill`, `decode`) re-execute themselves once, with it in LD_PRELOAD.

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


def reexec_with_allocator(command: str, environ=os.environ) -> None:
    """For a worker command run from the command line: re-execute this process (same pid, argv
    and interpreter options) with the chosen allocator preloaded; returns where there is
    nothing to do (another command, the choice made already, the system's allocator)."""
    if command not in WORKER_COMMANDS or environ.get(DONE) or not sys.platform.startswith("linux"):
        return
    library = wanted(environ)
    preload = environ.get("LD_PRELOAD", "")
    environ[DONE] = library or "system"
    if not library or os.path.basename(library).split(".")[0] in preload:
        return
    environ["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
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
