"""vLLM integration (the `vllm` extra's environment: vLLM installed, its CPU or CUDA build):
`connector` (SCDConnector, a vLLM KV connector that fills a vLLM consumer's cache from scd-serve
prefill workers' codes) and `source` (one prompt's codes fetched and rebuilt, no vLLM import).
Nothing else in scd_serve imports this package."""
