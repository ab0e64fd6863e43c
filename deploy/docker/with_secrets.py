"""Compose's secrets: made once by a one-shot service, then read by each role from its own volumes.

    python /opt/scd/with_secrets.py --make DIR        # the `secrets` service: make what is missing
    python /opt/scd/with_secrets.py DIR -- COMMAND    # a role: export what it mounts, exec COMMAND

DIR holds one sub-directory per volume (LAYOUT), and a role mounts only the volumes it needs
(docker-compose.yml): the gateway the control secret and the API key, a prefill worker the
control secret, the worker token and its own certificate, a decode worker the three secrets and
its own certificate. `--make` writes each missing secret as 32 random bytes (hex); a file is
created atomically (written aside, then hard-linked into place, which fails if another process
got there first). With mTLS on (SCD_MTLS unset or anything but 0/false/no/off) it makes a CA and
one certificate per role with make-certs.sh and puts each role's certificate, key and the CA in
that role's volume; the CA key is not kept. Grafana's admin password ($SCD_GRAFANA_PASSWORD, else
random) goes to the grafana volume, readable by Grafana's own user.

A role: a value already in the environment wins (put it in `.env` to choose your own);
otherwise the file is read if this container mounts it. SCD_TLS_DIR points at DIR/tls when
mTLS is on and the role's certificate volume is mounted there. The command then runs in place
of this process (exec: it stays PID 1 and gets the signals). Standard library only; nothing
is printed about the values.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile

SECRETS = {"SCD_CLUSTER_SECRET": ("control", "cluster-secret"), "SCD_API_KEY": ("api", "api-key"),
           "SCD_WORKER_TOKEN": ("token", "worker-token")}
TLS_ROLES = ("prefill", "decode")  # DIR/tls-ROLE when made; a role mounts its own at DIR/tls
GRAFANA = ("grafana", "admin-password")
OFF = {"0", "false", "no", "off"}
HERE = os.path.dirname(os.path.abspath(__file__))
# beside this file in the image (/opt/scd), deploy/scripts/ in a checkout
CANDIDATES = (os.path.join(HERE, "make-certs.sh"), os.path.join(HERE, "..", "scripts", "make-certs.sh"))
MAKE_CERTS = next((p for p in CANDIDATES if os.path.isfile(p)), "make-certs.sh")


def mtls_on(env) -> bool:
    return env.get("SCD_MTLS", "1").strip().lower() not in OFF


def shared_secret(directory: str, name: str, value: str = "", mode: int = 0o600) -> str:
    """DIR/name's content, creating it (`value`, else a fresh random one) if missing (race-safe)."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write((value or secrets.token_hex(32)) + "\n")
            os.chmod(tmp, mode)
            try:
                os.link(tmp, path)  # atomic; FileExistsError when another process won the race
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    with open(path) as f:
        value = f.read().strip()
    if not value:
        raise SystemExit(f"with_secrets: {path} is empty; remove it to make a new one")
    return value


def role_certs(directory: str) -> None:
    """DIR/tls-ROLE: the CA and ROLE's certificate and key, for each role, signed by one CA (once)."""
    targets = {role: os.path.join(directory, f"tls-{role}") for role in TLS_ROLES}
    if all(os.path.isfile(os.path.join(d, "ca.pem")) for d in targets.values()):
        return
    made = tempfile.mkdtemp(prefix="scd-tls.")
    try:
        subprocess.run(["sh", MAKE_CERTS, made], check=True, stdout=subprocess.DEVNULL)
        for role, target in targets.items():
            os.makedirs(target, exist_ok=True)
            for name in (f"{role}.pem", f"{role}-key.pem", "ca.pem"):  # ca.pem last: it says "complete"
                shutil.copy2(os.path.join(made, name), os.path.join(target, name))
    finally:
        shutil.rmtree(made, ignore_errors=True)


def make(directory: str, env) -> None:
    for sub, name in SECRETS.values():
        shared_secret(os.path.join(directory, sub), name)
    # Grafana runs as another user: its file is readable to all, in a volume only Grafana mounts
    shared_secret(os.path.join(directory, GRAFANA[0]), GRAFANA[1], env.get("SCD_GRAFANA_PASSWORD", "").strip(),
                  mode=0o444)
    if mtls_on(env):
        role_certs(directory)


def role_env(directory: str, env) -> dict[str, str]:
    out = dict(env)
    for var, (sub, name) in SECRETS.items():
        path = os.path.join(directory, sub, name)
        if not out.get(var, "").strip() and os.path.isfile(path):
            with open(path) as f:
                out[var] = f.read().strip()
    tls = os.path.join(directory, "tls")
    if mtls_on(env) and os.path.isfile(os.path.join(tls, "ca.pem")):
        out["SCD_TLS_DIR"] = tls
    return out


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--make":
        make(argv[1], os.environ)
        return 0
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.splitlines()[2].strip() + "\n" + __doc__.splitlines()[3].strip(), file=sys.stderr)
        return 2
    directory, command = argv[0], argv[2:]
    os.execvpe(command[0], command, role_env(directory, os.environ))
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
