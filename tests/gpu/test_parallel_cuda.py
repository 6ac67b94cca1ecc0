"""FSDP1, FSDP2 and tensor parallelism on CUDA over smddp, against one process.

Skipped without CUDA. Two ranks share the GPUs round-robin (both on one GPU where there is
only one, which smddp's staged path allows and NCCL refuses). The cases are the CPU tests'
own (tests/distributed/test_hybrid_mixed_precision.py, test_tp_parity.py) run with
``device="cuda"``:

- FSDP1 called as SMP's scripts call it: ``device_id=torch.cuda.current_device()``,
  ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=fp32)``,
  ``use_orig_params=True``, ``HYBRID_SHARD`` after ``tsm.init``, with activation checkpointing
  applied after wrapping; and FSDP2 (``shard_model``, bf16 parameters, fp32 reduction). Each
  trains 4 steps and is compared with the fp32 one-process reference on the global batch:
  losses, gradient norms and each parameter's update, with the CPU test's tolerances for
  bf16 against fp32.
- FSDP1 HYBRID_SHARD on 4 ranks with the replicas' all-reduce during backward, against its
  synchronous reduction (``test_replica_reduction.py``'s cases on ``device="cuda"``).
- Tensor parallelism (DTensor, tp=2) for every model family: logits, loss, every gradient
  and 5 AdamW steps against the untransformed model on the same GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import test_hybrid_mixed_precision as hmp
from tests.distributed import test_replica_reduction as rr
from tests.distributed import test_tp_parity as tpp
from tests.distributed.hf_models import reference_run, tiny_llama
from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

# (api, activation checkpointing) as in the CPU test; "after_wrap" is SMP's examples' order.
CUDA_CASES = [("fsdp1", False), ("fsdp1", "after_wrap"), ("fsdp2", False), ("fsdp2", True)]


def test_fsdp1_and_fsdp2_bf16_on_cuda_match_one_process():
    per_rank = run_distributed(hmp._train, CUDA_CASES, "cuda", backend="smddp", timeout=600)
    fp32_ref = reference_run(hmp.STEPS, hmp.GLOBAL_BATCH, hmp.LR, hmp.MAX_NORM)
    init = {n: p.detach() for n, p in tiny_llama().named_parameters()}
    tolerances = {"fsdp1": hmp.FP32_TOL, "fsdp2": hmp.FP32_TOL}
    hmp.check_parity(per_rank, [(fp32_ref, tolerances, "fp32")], init, exact_checkpointing=False)


def test_tensor_parallel_on_cuda_matches_one_process():
    per_rank = run_distributed(
        tpp._parity_all_families,
        tpp.FAMILIES,
        2,
        0,
        False,
        "cuda",
        backend="smddp",
        timeout=600,
    )
    for results in per_rank:
        tpp.check(results)


def test_fsdp1_replicas_all_reduce_during_backward_on_cuda():
    """FSDP1 HYBRID_SHARD (2 replicas of 2 ranks) with the replicas' all-reduce deferred,
    against FSDP1's synchronous reduction on the same GPUs: FSDP1 divides and casts on its
    all-reduce stream, which the deferred all-reduce must wait for
    (tests/distributed/test_replica_reduction.py; the tolerance allows for GPU kernels, a
    missed division is off by a factor of 2)."""
    cases = [("fp32", None), ("bf16", None), ("bf16", "each")]
    per_rank = run_distributed(
        rr._fsdp1_cases, 2, cases, "cuda", world_size=4, backend="smddp", timeout=600
    )
    rr.check_fsdp1(per_rank, 2, rtol=1e-3)
