"""`python -m scd_serve.transport.health_probe HOST:PORT`: exit 0 iff grpc health says SERVING.

Used by Docker HEALTHCHECK and k8s exec probes. Plaintext by default; pass --tls-ca (and
--tls-cert/--tls-key for mTLS) when the worker listens with TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from scd_serve.config.transport import TransportConfig


async def probe(address: str, config: TransportConfig, timeout: float) -> bool:
    from scd_serve.transport.client import PrefillClient

    client = PrefillClient(address, config)
    try:
        return await client.serving(timeout=timeout)
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scd_serve.transport.health_probe", description=__doc__.splitlines()[0])
    p.add_argument("address", help="HOST:PORT of a prefill worker's gRPC listener")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds before the probe gives up")
    p.add_argument("--tls-ca", default="")
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-server-name", default="")
    args = p.parse_args(argv)
    config = TransportConfig(rpc_timeout_s=args.timeout, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                             tls_key=args.tls_key, tls_server_name=args.tls_server_name)
    ok = asyncio.run(probe(args.address, config, args.timeout))
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
