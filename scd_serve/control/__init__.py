"""Control plane: a ZMQ registry of workers, heartbeats with load, load-aware choice (no torch)."""
