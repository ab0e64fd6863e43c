"""Build the generated gRPC code from proto/scd/v1/scd.proto into scd_serve/_proto/.

Generated code is not committed: the first import after `pip install -e .` (or after the
.proto changed) compiles it with grpc_tools.protoc. Several processes may start together
(`scd-serve up`), so the check-and-build runs under a file lock and files are renamed
into place atomically.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # scd_serve/
OUT_DIR = PACKAGE_DIR / "_proto"
PROTO_REL = Path("scd/v1/scd.proto")
LOCK_TIMEOUT_S = 60.0


def proto_root() -> Path | None:
    """Directory holding scd/v1/scd.proto: $SCD_PROTO_DIR, else the repo's proto/."""
    for root in (os.environ.get("SCD_PROTO_DIR"), PACKAGE_DIR.parent / "proto"):
        if root and (Path(root) / PROTO_REL).is_file():
            return Path(root)
    return None


def _generated() -> list[Path]:
    d = OUT_DIR / PROTO_REL.parent
    return [d / "scd_pb2.py", d / "scd_pb2_grpc.py"]


def _stale(src: Path) -> bool:
    files = _generated()
    if not all(f.is_file() for f in files):
        return True
    return min(f.stat().st_mtime for f in files) < src.stat().st_mtime


def _lock(fd: int) -> None:
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {LOCK_TIMEOUT_S:.0f} s for the proto build lock in {OUT_DIR}")
            time.sleep(0.05)


def _compile(root: Path) -> None:
    from grpc_tools import protoc  # only needed when building

    with tempfile.TemporaryDirectory(dir=OUT_DIR) as tmp:
        include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{root}", f"-I{include}",
            f"--python_out={tmp}", f"--grpc_python_out={tmp}", str(root / PROTO_REL),
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc}) on {root / PROTO_REL}")
        gen = Path(tmp) / PROTO_REL.parent
        # grpc's plugin writes an absolute import of the message module; make it relative
        grpc_file = gen / "scd_pb2_grpc.py"
        grpc_file.write_text(grpc_file.read_text().replace("from scd.v1 import scd_pb2", "from . import scd_pb2"))
        dest = OUT_DIR / PROTO_REL.parent
        dest.mkdir(parents=True, exist_ok=True)
        for pkg in (OUT_DIR, OUT_DIR / "scd", dest):
            (pkg / "__init__.py").touch()
        for name in ("scd_pb2.py", "scd_pb2_grpc.py"):
            os.replace(gen / name, dest / name)  # atomic: readers never see half a file


def ensure_built() -> Path:
    """Make sure scd_serve/_proto/scd/v1/scd_pb2*.py exist and are newer than the .proto."""
    root = proto_root()
    if root is None:
        if all(f.is_file() for f in _generated()):
            return OUT_DIR  # installed without the .proto: use what was built at install
        raise ImportError("proto/scd/v1/scd.proto not found; install with `pip install -e .` "
                          "from a checkout or set SCD_PROTO_DIR to the proto/ directory")
    if not _stale(root / PROTO_REL):
        return OUT_DIR
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(OUT_DIR / ".build.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        _lock(fd)
        if _stale(root / PROTO_REL):  # another process may have built it while we waited
            _compile(root)
    finally:
        os.close(fd)  # closing releases the flock
    return OUT_DIR


def clean() -> None:
    """Remove the generated code (tests use this to check a rebuild)."""
    shutil.rmtree(OUT_DIR, ignore_errors=True)
