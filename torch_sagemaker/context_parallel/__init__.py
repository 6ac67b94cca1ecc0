"""Context parallelism: every sequence split over ``context_parallel_degree`` ranks.

``tsm.transform`` calls ``prepare_model`` when ``context_parallel_degree > 1``; a training
script splits its batches with ``split_sequence`` (SMP's layout) and calls the model as
before. See docs/context_parallel.md for the contract.

Modules: ``layout`` (zigzag index arithmetic), ``blocks`` (one attention block and the
exact merge), ``ring`` (``cp_comm_type="p2p"``), ``allgather`` (``"all_gather"``),
``attention`` (the Hugging Face attention function), ``loss`` (labels shifted across
ranks), ``prepare`` (what ``tsm.transform`` changes), ``sequence`` (split/gather helpers).
"""

from torch_sagemaker.context_parallel.attention import ATTENTION_NAME, COMM_TYPES
from torch_sagemaker.context_parallel.layout import local_positions, merge_locals, split_local
from torch_sagemaker.context_parallel.prepare import (
    check_prepared,
    is_context_parallel,
    prepare_model,
)
from torch_sagemaker.context_parallel.sequence import gather_sequence, split_sequence

__all__ = [
    "ATTENTION_NAME",
    "COMM_TYPES",
    "check_prepared",
    "gather_sequence",
    "is_context_parallel",
    "local_positions",
    "merge_locals",
    "prepare_model",
    "split_local",
    "split_sequence",
]
