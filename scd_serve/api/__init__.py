"""The HTTP surface: `app.create_app(config, backend)`, OpenAI routes, SSE, health, /metrics."""
