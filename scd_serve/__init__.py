"""scd-serve: disaggregated LLM serving with Semantic Cache Distillation."""

__version__ = "0.1.0"
