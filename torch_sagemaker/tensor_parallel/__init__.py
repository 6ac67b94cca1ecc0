"""Tensor parallelism.

Plan application (DTensor styles), the Transformer Engine backend, the TP-region RNG tracker,
the vocabulary-parallel loss and rank-0 weight loading.

Entry point for users is ``tsm.transform``; the pieces here are public for policy authors.
"""

from __future__ import annotations

from torch_sagemaker.tensor_parallel.implementation import select_backend, te_available, use_backend
from torch_sagemaker.tensor_parallel.loss import causal_lm_loss, vocab_parallel_cross_entropy
from torch_sagemaker.tensor_parallel.random import RNGStatesTracker

__all__ = [
    "RNGStatesTracker",
    "causal_lm_loss",
    "select_backend",
    "te_available",
    "use_backend",
    "vocab_parallel_cross_entropy",
]
