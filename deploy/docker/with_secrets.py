"""Compose entrypoint: make the cluster's secrets on first start, export them, exec the command.

    python /opt/scd/with_secrets.py DIR -- COMMAND [ARG...]

For each secret below, a value already in the environment wins (put it in `.env` to choose
your own); otherwise it is read from DIR/NAME, which is created with 32 random bytes (hex) if
it does not exist yet. DIR is a volume every container of the project mounts, so all roles
get the same values; a file is created atomically (written aside, then hard-linked into
place, which fails if another container got there first), so containers that start at the
same moment still agree. With SCD_MTLS set (to anything), DIR/tls gets a CA and one
certificate per role from make-certs.sh the same way, and SCD_TLS_DIR points at it.
The command then runs in place of this process (exec: it stays PID 1 and gets the signals).
Standard library only; nothing is printed about the values.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile

SECRETS = {"SCD_CLUSTER_SECRET": "cluster-secret", "SCD_API_KEY": "api-key", "SCD_WORKER_TOKEN": "worker-token"}
HERE = os.path.dirname(os.path.abspath(__file__))
# beside this file in the image (/opt/scd), deploy/scripts/ in a checkout
CANDIDATES = (os.path.join(HERE, "make-certs.sh"), os.path.join(HERE, "..", "scripts", "make-certs.sh"))
MAKE_CERTS = next((p for p in CANDIDATES if os.path.isfile(p)), "make-certs.sh")


def shared_secret(directory: str, name: str) -> str:
    """DIR/name's content, creating it with a fresh random value if missing (race-safe)."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)  # atomic; FileExistsError when another container won the race
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    with open(path) as f:
        value = f.read().strip()
    if not value:
        raise SystemExit(f"with_secrets: {path} is empty; remove it to make a new one")
    return value


def shared_certs(directory: str) -> str:
    """DIR/tls with a CA and prefill/decode certificates, made once (race-safe)."""
    final = os.path.join(directory, "tls")
    if not os.path.isdir(final):
        tmp = tempfile.mkdtemp(dir=directory, prefix=".tls.")
        try:
            subprocess.run(["sh", MAKE_CERTS, tmp], check=True, stdout=subprocess.DEVNULL)
            os.rename(tmp, final)  # atomic; fails when another container renamed its own first
        except OSError:
            if not os.path.isdir(final):
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    directory, command = argv[0], argv[2:]
    env = dict(os.environ)
    for var, name in SECRETS.items():
        if not env.get(var, "").strip():
            env[var] = shared_secret(directory, name)
    if env.get("SCD_MTLS", "").strip():
        env["SCD_TLS_DIR"] = shared_certs(directory)
    os.execvpe(command[0], command, env)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
