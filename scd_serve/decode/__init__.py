"""Decode worker: pulls codes from prefill workers, rebuilds them into the KV pool, serves HTTP."""
