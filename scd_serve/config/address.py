"""HOST:PORT strings: checked where settings and registry messages name a worker, joined
where a listener binds. Plain string work, below every package that needs it."""

from __future__ import annotations

MAX_ADDRESS = 256  # characters


def check_address(address) -> str:
    """`address` if it is HOST:PORT with a port in 1..65535, printable ASCII (it becomes a metric
    label and a URL), else ValueError."""
    if not isinstance(address, str) or not 0 < len(address) <= MAX_ADDRESS:
        raise ValueError("address must be a HOST:PORT string")
    host, sep, port = address.rpartition(":")
    if not (address.isascii() and address.isprintable()) or " " in address:
        raise ValueError(f"address {address[:64]!r} must be printable ASCII without spaces")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return address


def join_host_port(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
