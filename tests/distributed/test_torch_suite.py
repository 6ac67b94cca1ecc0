"""PyTorch's own distributed test suite (torch.testing._internal.distributed's
DistributedTest) on smddp: a curated part that runs in well under a minute.

The whole suite (285 cases) runs on gloo and on smddp with
``python -m tests.distributed.torch_suite_compare`` (cases in chunks in the same three
ranks, or with ``--spawn`` each in freshly spawned ranks as PyTorch runs it); that
comparison is how the cases below were chosen (docs/collectives.md gives its result). Here
they run one after another in the same three ranks (``torch_suite_driver.run_cases``), each
through the suite's own per-rank entry point.
"""

import pytest

from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]
pytest.importorskip("expecttest", reason="the suite imports expecttest (requirements-dev.txt)")

# Every case gloo passed that smddp failed before (the first two groups), then one or more
# of each kind of call the suite makes on a CPU backend, among the cases gloo and smddp both
# pass in well under a second (the comparison's JSON lists them all).
CASES = [
    # c10d's all_gather_coalesced semantics: one output list per rank.
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_complex",
    "test_all_gather_coalesced_full_group",
    "test_all_gather_coalesced_with_empty",
    # Receive from any rank.
    "test_send_recv_any_source",
    "test_send_recv_any_source_autograd_profiler",
    # Sparse all_reduce (skipped by the suite for any backend but gloo).
    "test_sparse_all_reduce_sum",
    # The rest.
    "test_all_reduce_sum",
    "test_all_reduce_sum_complex",
    "test_all_reduce_sum_async",
    "test_all_reduce_coalesced_sum",
    "test_reduce_sum",
    "test_reduce_max",
    "test_broadcast",
    "test_gather",
    "test_gather_checks",
    "test_scatter",
    "test_scatter_checks",
    "test_all_gather",
    "test_all_to_all",
    "test_all_to_all_single_unequal_split",
    "test_send_recv",
    "test_send_recv_with_tag",
    "test_isend",
    "test_irecv",
    "test_batch_isend_irecv_gloo",
    "test_all_gather_object_default_pg",
    "test_destroy_group",
    "test_DistributedDataParallelCPU",
]


def _run_cases(root):
    from tests.distributed.torch_suite_driver import run_cases

    # Some cases (all_reduce_coalesced, batch_isend_irecv, all_gather_object) are restricted
    # to gloo by name; they run here all the same, since the point is smddp doing what gloo
    # does.
    return run_cases(CASES, root, honour_skips=False)


def test_pytorch_distributed_suite_on_smddp(tmp_path):
    results = run_distributed(
        _run_cases,
        str(tmp_path),
        world_size=3,
        backend="smddp",
        init_process_group=False,
        timeout=900,
        env={"BACKEND": "smddp", "WORLD_SIZE": "3", "TEMP_DIR": str(tmp_path)},
    )
    problems = []
    for rank, per_case in enumerate(results):
        assert list(per_case) == CASES
        # Every case listed runs here (none is skipped for smddp or for 3 ranks): each must pass.
        problems += [
            f"rank {rank} {name}: {outcome}: {detail}"
            for name, (outcome, detail) in per_case.items()
            if outcome != "passed"
        ]
    assert not problems, "\n".join(problems)
