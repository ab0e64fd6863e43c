"""The single HTTP entry point: spreads OpenAI requests over decode workers by load."""
