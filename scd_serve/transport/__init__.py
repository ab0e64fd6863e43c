"""gRPC transport between prefill and decode workers: generated scd.v1 code, channels and
servers with caps/auth/TLS, chunk checksums and verification."""
