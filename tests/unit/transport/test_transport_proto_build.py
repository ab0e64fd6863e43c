"""Generated code is built on demand, rebuilt when stale, and safe with concurrent builders."""

import os
import threading

from scd_serve.transport import proto_build


def test_builds_when_missing_and_when_older_than_proto(tmp_path, monkeypatch):
    out = tmp_path / "_proto"
    monkeypatch.setattr(proto_build, "OUT_DIR", out)
    proto_build.ensure_built()
    pb2, grpc_file = proto_build._generated()
    assert pb2.is_file() and grpc_file.is_file()
    assert "from . import scd_pb2" in grpc_file.read_text()

    src = proto_build.proto_root() / proto_build.PROTO_REL
    old = src.stat().st_mtime - 10  # generated before the .proto last changed
    os.utime(pb2, (old, old))
    assert proto_build._stale(src)
    proto_build.ensure_built()
    assert pb2.stat().st_mtime > old


def test_concurrent_builders_agree(tmp_path, monkeypatch):
    monkeypatch.setattr(proto_build, "OUT_DIR", tmp_path / "_proto")
    errors = []

    def build():
        try:
            proto_build.ensure_built()
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert all(f.stat().st_size > 0 for f in proto_build._generated())
