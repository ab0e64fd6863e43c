"""Prefill worker: runs the producer layer by layer and streams encoded codes over gRPC."""
