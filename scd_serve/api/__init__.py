"""The HTTP surface: `app.create_app(config, backend)` with OpenAI routes, SSE, health and
/metrics. Nothing is imported here."""
