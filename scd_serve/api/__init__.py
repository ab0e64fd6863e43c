"""The HTTP surface: `app.create_app(config, backend)` with OpenAI routes, SSE, health and
/metrics; `backend.EngineBackend` adapts an Engine; `metrics.Metrics` is shared with the
transfer side. Nothing is imported here."""
