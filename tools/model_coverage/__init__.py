"""TP parity over every causal-LM family of transformers: ``python -m tools.model_coverage``."""
