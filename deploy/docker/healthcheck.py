"""Container health check for every scd-serve role: exit 0 iff the role in PID 1 is ready.

One image runs every role, so the check reads the role and port from PID 1's command line
(`scd-serve prefill --port 50051 ...`): prefill answers grpc.health.v1 SERVING, decode and
gateway answer 200 on /ready. Only 127.0.0.1 is probed. A prefill worker started with
--tls-cert/--tls-key/--tls-ca (mTLS) is probed over TLS with its own certificate, which
names 127.0.0.1 (deploy/scripts/make-certs.sh). Standard library only, except the prefill
probe, which is the project's own module.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request

ROLES = ("prefill", "decode", "gateway")
TIMEOUT_S = 4.0
TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")


def role_and_port(argv: list[str]) -> tuple[str, int]:
    """The scd-serve role and its --port from a command line; raises ValueError."""
    role = next((a for a in argv if a in ROLES), None)
    if role is None:
        raise ValueError(f"no scd-serve role in command line {argv!r}")
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            return role, int(argv[i + 1])
        if arg.startswith("--port="):
            return role, int(arg.split("=", 1)[1])
    raise ValueError(f"no --port in command line {argv!r}")


def flag_values(argv: list[str], flags=TLS_FLAGS) -> dict[str, str]:
    """The values of `flags` in a command line, as `--flag value` or `--flag=value`."""
    found = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in flags:
            if eq:
                found[name] = value
            elif i + 1 < len(argv):
                found[name] = argv[i + 1]
    return found


def pid1_argv() -> list[str]:
    with open("/proc/1/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]


def probe(role: str, port: int, tls: dict[str, str] | None = None) -> bool:
    if role == "prefill":
        cmd = [sys.executable, "-m", "scd_serve.transport.health_probe", f"127.0.0.1:{port}"]
        for flag, value in (tls or {}).items():
            cmd += [flag, value]
        try:
            return subprocess.run(cmd, timeout=TIMEOUT_S).returncode == 0
        except subprocess.TimeoutExpired:
            return False
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=TIMEOUT_S) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main() -> int:
    try:
        argv = pid1_argv()
        role, port = role_and_port(argv)
    except ValueError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    ok = probe(role, port, flag_values(argv))
    print(f"healthcheck: {role} on port {port}: {'ready' if ok else 'not ready'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
