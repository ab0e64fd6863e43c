"""C++ kernels for the CPU's steps (csrc/), built once per machine where a compiler is.

A decode step through torch ops gathers every sequence's blocks into a copy for attention (two
batched matmuls, a mask and a softmax: ~0.3 ms a layer at 8 sequences of 300 keys on the
Qwen2.5-0.5B shape), and runs RMSNorm, the rotary and the pool's writes, and SiLU's product as
a few dozen small ops a layer: ~18 ms of a 65 ms step beside the linears. The kernels:
`decode_attention` reads the pool's blocks in place in one call a layer (model/paged.py's
`attend_gathered` is its reference, and serves until the kernels are in use or where they cannot
be built); `prefill_attention` does the same for a prompt chunk's queries (causal, a running
softmax over key tiles; paged.py's `attend_paged` is its reference), where it runs vectorized
(AVX-512: `prefill_ops`); `rms_norm`, `rope_write` and `silu_mul` do the rest in one pass each,
rounding where model/layers.py and model/rope.py round (bfloat16: the same numbers, but for
RMSNorm's order of sums and exp's last float bit in SiLU).

Built with torch's cpp_extension (a C++ compiler and ninja; `-march=native`, so the build's
name carries this CPU's flags and a machine of another CPU builds its own) into
$SCD_KERNEL_CACHE (~/.cache/scd-serve/kernels; each build in a directory of its own, its library
then renamed into place: no lock between processes). A serving role loads this machine's build at
start; where there is none yet it builds it in a background thread and serves on the torch path
meanwhile (~25-35 s on two cores). `scd-serve build-kernels` builds it ahead (`bench peer`
does). SCD_CPU_KERNELS=off keeps the torch path.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from scd_serve.errors import ConfigError

Tensor = torch.Tensor
log = logging.getLogger("scd_serve.model")
ENV = "SCD_CPU_KERNELS"
CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("bindings.cpp", "decode_attention.cpp", "prefill_attention.cpp", "elementwise.cpp"))
HEADERS = (CSRC / "support.h", CSRC / "vec.h")  # included by the sources: part of the build's name too
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]  # fast-math: the softmax's exp vectorized

_lock = threading.Lock()
_module: ModuleType | None = None
_other_builds: dict[str, ModuleType] = {}  # -march -> the kernels built for it (load_for)
_thread: threading.Thread | None = None
_in_use = False  # whether this process's steps take the kernels: a serving role's start turns it on


def unavailable_reason() -> str | None:
    """Why the kernels cannot be built here (None: they can); ConfigError for a bad SCD_CPU_KERNELS."""
    mode = os.environ.get(ENV, "auto")
    if mode not in ("auto", "off"):
        raise ConfigError(f"{ENV}={mode!r}: use auto (build and use them where a compiler is) or off")
    if mode == "off":
        return f"{ENV}=off"
    if _built().exists():  # this machine's build, made before: no compiler needed
        return None
    if not shutil.which(os.environ.get("CXX", "c++")):
        return "no C++ compiler (install g++, or set CXX)"
    from torch.utils import cpp_extension

    _ninja_on_path()
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH: the ninja package's binary sits in the venv's bin, which a
    worker started by its full path (`.venv/bin/scd-serve`) may not have on PATH."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def build_name() -> str:
    """The build's name: the sources, the flags, torch's version and this CPU's flags."""
    digest = hashlib.sha256(_sources_digest())
    digest.update(" ".join(FLAGS).encode() + torch.__version__.encode() + _cpu_flags().encode())
    return f"scd_cpu_ops_{digest.hexdigest()[:16]}"


@functools.cache  # a start asks for the name several times: the sources are read once
def _sources_digest() -> bytes:
    digest = hashlib.sha256()
    for src in SOURCES + HEADERS:
        digest.update(src.read_bytes())
    return digest.digest()


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def _build_dir() -> Path:
    cache = Path(os.environ.get("SCD_KERNEL_CACHE", Path.home() / ".cache" / "scd-serve" / "kernels"))
    return cache / build_name()


def _built() -> Path:
    """Where this machine's build of the kernels is (or goes)."""
    return _build_dir() / f"{build_name()}.so"


def load() -> ModuleType:
    """Build (or load the earlier build of) the kernels, now; raises where they cannot be built."""
    global _module
    with _lock:
        if _module is None:
            reason = unavailable_reason()
            if reason:
                raise RuntimeError(f"CPU kernels unavailable: {reason}")
            _module = _load_or_build(_built())
        return _module


def load_for(march: str) -> ModuleType:
    """The kernels built for another instruction set than this CPU's (`-march`, one below it:
    the tests run the vector paths of other CPUs here), cached beside this CPU's build."""
    with _lock:
        if march not in _other_builds:
            name = f"{build_name()}_{march.replace('-', '_')}"
            _other_builds[march] = _load_or_build(_build_dir().parent / name / f"{name}.so", march)
        return _other_builds[march]


def _load_or_build(built: Path, march: str = "native") -> ModuleType:
    if built.exists():  # imported as it is: cpp_extension would write a lock file (a read-only image)
        spec = importlib.util.spec_from_file_location(built.stem, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return build_and_publish(built, lambda work: compile_sources(built.stem, CSRC, work, march))


STALE_BUILD_S = 3600  # a private build directory this old belongs to a build that was killed


def build_and_publish(built: Path, build: Callable[[Path], ModuleType]) -> ModuleType:
    """build(directory) in a directory of this process's own, then its library moved to `built`
    in one rename: processes share no lock. torch's build lock, left behind by a build that was
    killed (a worker stopped during its first start), made every later build wait for ever; now
    two processes that build at once each build, and the last rename wins with an equal library."""
    built.parent.mkdir(parents=True, exist_ok=True)
    for old in built.parent.glob("build-*"):
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(old, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=built.parent))
    try:
        module = build(work)
        os.replace(work / built.name, built)  # the module stays loaded from the moved file
        return module
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compile_sources(name: str, source_dir: Path, build_dir: Path, march: str = "native") -> ModuleType:
    """Build the kernels' sources (SOURCES' names) found in source_dir, as module `name`; `march`
    another instruction set than this CPU's (the tests build the vector paths of CPUs below it)."""
    from torch.utils import cpp_extension

    flags = [f"-march={march}" if f == "-march=native" else f for f in FLAGS]
    return cpp_extension.load(name=name, sources=[str(source_dir / s.name) for s in SOURCES], extra_cflags=flags,
                              extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


def use(on: bool = True) -> None:
    """Whether this process's decode steps take the kernels (building them first where need
    be); a serving role's start turns them on, tests and benchmarks choose."""
    global _in_use
    if on:
        load()
    _in_use = on


def start() -> bool:
    """A serving role's start: load this machine's build of the kernels now, or where there is
    none yet build it in a background thread (the torch path serves meanwhile). -> whether they
    are or may come (False: the torch path throughout; the reason is logged)."""
    global _thread
    reason = unavailable_reason()
    if reason:
        log.info("CPU kernels: not used (%s)", reason)
        return False
    if _built().exists():
        _load_and_say()  # built before: loading it takes a moment
        return _in_use
    with _lock:
        if _thread is None and _module is None:
            log.info("CPU kernels: building in the background (once per machine; the torch path serves until then)")
            _thread = threading.Thread(target=_load_and_say, name="scd-kernels", daemon=True)
            _thread.start()
    return True


def _load_and_say() -> None:
    began = time.monotonic()
    try:
        use(True)
        log.info("CPU kernels loaded (%.1f s): decode steps attend, normalize, rotate and gate in C++",
                 time.monotonic() - began)
    except Exception as exc:  # noqa: BLE001 - the torch path serves on; say why once
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        log.warning("CPU kernels: not used (the build failed: %s)", last)


def attend_blocks(k_layer: Tensor, v_layer: Tensor, tables: Tensor, lengths: Tensor, q: Tensor,
                  window: int | None) -> Tensor:
    """One query per sequence over its blocks, read in place; paged.attend_gathered's contract.
    k_layer, v_layer: [num_blocks, block_size, kv_heads, hd]; tables: [B, W] block ids; lengths:
    [B] keys per sequence; q: [B, heads, hd] (bfloat16 or float32). -> [B, heads*hd]"""
    assert _module is not None, "cpu_kernel.attend_blocks before the kernels are loaded"
    return _module.decode_attention(q, k_layer, v_layer, tables, lengths, window or 0, q.shape[-1] ** -0.5)


def prefill(q: Tensor, k_layer: Tensor, v_layer: Tensor, table: Tensor, first: int, window: int | None) -> Tensor:
    """Causal attention of one sequence's queries at positions first.. over its blocks, read in
    place (paged.attend_paged's contract). q: [T, heads, hd]; k_layer, v_layer: [num_blocks,
    block_size, kv_heads, hd]; table: [W] the sequence's block ids. -> [T, heads*hd]"""
    assert _module is not None, "cpu_kernel.prefill before the kernels are loaded"
    return _module.prefill_attention(q, k_layer, v_layer, table, first, window or 0, q.shape[-1] ** -0.5)


def prefill_ops(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """ops(), where its prefill attention is also vectorized here (AVX-512: faster than SDPA and
    the bfloat16 matmul blocks); None: the torch path's prefill attention."""
    module = ops(device, dtype)
    return module if module is not None and module.prefill_vectorized else None


def ops(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The kernels, where this process's steps take them for tensors of this device and dtype
    (never waits for a build); None: the torch path. Besides `decode_attention` (attend_blocks):
    `prefill_attention` (prefill), `rms_norm(x, weight, eps)`, `rope_write(q, k, v, cos, sin, k_layer, v_layer, slots) -> q`
    (rotates q and k, writes k and v into the pool) and `silu_mul(gate_up)`, each one pass where
    torch runs several ops, rounding where model/layers.py and model/rope.py round."""
    if _in_use and device.type == "cpu" and dtype in (torch.bfloat16, torch.float32):
        return _module
    return None


def add_arguments(parser) -> None:  # `scd-serve build-kernels`: no options
    del parser


def run(args) -> int:
    began = time.monotonic()
    try:
        load()
    except (RuntimeError, OSError) as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(f"CPU kernels ready in {_build_dir()} ({time.monotonic() - began:.1f} s)")
    return 0
