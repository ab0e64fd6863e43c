"""One validated dataclass per concern (engine.py, api.py, transport.py, ...), built at the entry point."""
