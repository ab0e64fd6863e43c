"""Checks a role makes before it loads anything: its ports free, its model directory there. Each
failure is one ConfigError line that says what to do (the CLI prints it and exits 2), instead
of a traceback once the weights are loaded. (A codebook of another pair: codec/codebook.py.)"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

from scd_serve.config.address import join_host_port
from scd_serve.errors import ConfigError

BUILD_PAIR = "scd-serve make-demo-pair"  # what makes the embedded pairs' models


def check_port(host: str, port: int, flag: str = "--port") -> None:
    """Refuse a port something already listens on (port 0 lets the OS pick: always free)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no owner
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is in use (another scd-serve? `make run` starts one): "
                                  f"stop it, or pass {flag} N (0 = any free port)") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"{join_host_port(host, port)}: {host} is not an address of this machine; "
                                  f"pass --host 127.0.0.1 (or 0.0.0.0 for every interface)") from None
            raise ConfigError(f"cannot listen on {join_host_port(host, port)}: {exc.strerror}") from None


def check_model_dir(path: str, flag: str = "--model") -> None:
    """Refuse a directory without a Hugging Face config.json (or a PEFT adapter's) before any weight is read."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{flag} {path}: no such directory; pass a Hugging Face model directory (config.json "
                          f"and *.safetensors), or build the embedded pairs' models: {BUILD_PAIR}")
    if not (p / "config.json").is_file() and not (p / "adapter_config.json").is_file():
        raise ConfigError(f"{flag} {path}: no config.json there, so not a model directory; pass the directory "
                          f"that holds config.json and the *.safetensors files (or a LoRA adapter's, "
                          f"adapter_config.json)")


def check_zmq_bind(url: str, flag: str) -> None:
    """A tcp://HOST:PORT bind address (the control plane's) is free; other transports pass."""
    if url.startswith("tcp://"):
        host, _, port = url[len("tcp://"):].rpartition(":")
        if port.isdigit():
            check_port(host.strip("[]") or "0.0.0.0", int(port), flag)
