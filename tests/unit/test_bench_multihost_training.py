"""``bench multihost --train``'s bookkeeping: the runs, the split of a step, the table.

The training itself runs in tests/distributed/test_bench_multihost.py (2x2 and one host);
these check, without processes, what its numbers are made of: which rank's split a step
reports (Note [Exposed communication]), that the wrapped collectives are timed and put
back, and how the table finds one host's run and flags losses apart."""

import time

import pytest
import torch
import torch.distributed as dist

from benchmarks import multihost, multihost_training_report
from benchmarks.multihost_training import Blocked, Run, runs_for, summarise


def test_each_layout_trains_its_hybrid_shape_and_fsdp2_over_every_rank():
    setups = ["fsdp2", "fsdp1_hybrid", "fsdp2_hybrid"]
    assert runs_for(setups, 2, 2) == [
        Run("fsdp2", 1, 4),
        Run("fsdp1_hybrid", 2, 2),
        Run("fsdp2_hybrid", 2, 2),
    ]
    # 4x1 and 2x2 have the same ranks and different hybrid shapes: one host runs both.
    assert runs_for(["fsdp1_hybrid"], 4, 1) == [Run("fsdp1_hybrid", 4, 1)]


def _step(seconds: float, all_gather: float, all_reduce: float, loss: float) -> dict:
    return {
        "seconds": seconds,
        "blocked": {"all_gather": all_gather, "reduce_scatter": 0.0, "all_reduce": all_reduce},
        "calls": {"all_gather": 3, "reduce_scatter": 0, "all_reduce": 2},
        "async_calls": 0,
        "loss": loss,
    }


def test_a_step_is_split_on_the_rank_with_the_most_compute():
    # Rank 1 computes 0.8 s and waits 0.2 s; rank 0 computes 0.5 s and waits 0.5 s, of
    # which 0.3 s is waiting for rank 1: rank 1's split is the step's.
    per_rank = [
        [_step(9.0, 9.0, 0.0, 5.0), _step(1.0, 0.2, 0.3, 4.0), _step(1.2, 0.3, 0.4, 3.0)],
        [_step(9.0, 0.0, 0.0, 5.5), _step(1.0, 0.1, 0.1, 4.5), _step(1.1, 0.1, 0.1, 3.5)],
    ]
    record = summarise(Run("fsdp2_hybrid", 2, 1), "smddp", "bfloat16", per_rank, 100)
    assert record["step_s"] == pytest.approx(1.1)  # median of the slowest ranks' 1.0 and 1.2
    assert record["tokens_per_s"] == pytest.approx(100 / 1.1)
    assert record["compute_s"] == pytest.approx((0.8 + 0.9) / 2)  # the first step is untimed
    assert record["exposed_s"]["all_gather"] == pytest.approx(0.1)
    assert record["exposed_s"]["all_reduce"] == pytest.approx(0.1)
    assert record["calls"] == {"all_gather": 3, "reduce_scatter": 0, "all_reduce": 2}
    assert record["losses"] == [[5.0, 4.0, 3.0], [5.5, 4.5, 3.5]]
    assert (record["setup"], record["replicas"], record["shard"]) == ("fsdp2_hybrid", 2, 1)


@pytest.fixture
def one_rank_group():
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def test_collectives_are_timed_while_blocked_and_put_back_after(one_rank_group):
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}
    t = torch.ones(4)
    with Blocked() as blocked:
        start = time.perf_counter()
        dist.all_reduce(t)
        dist.all_gather([torch.empty(4)], t)
        dist.all_reduce(t, async_op=True).wait()  # counted until it returns, and flagged
        inside = time.perf_counter() - start
    assert blocked.calls == {"all_gather": 1, "reduce_scatter": 0, "all_reduce": 2}
    assert blocked.async_calls == 1
    assert 0 < sum(blocked.seconds.values()) <= inside
    assert {name: getattr(dist, name) for name in originals} == originals
    dist.all_reduce(t)  # outside the block: not counted
    assert blocked.calls["all_reduce"] == 2


def _record(layout_backend: str, tokens: float, losses: list[list[float]], **kw) -> dict:
    return {
        "setup": kw.get("setup", "fsdp1_hybrid"),
        "replicas": kw.get("replicas", 2),
        "shard": kw.get("shard", 2),
        "backend": layout_backend,
        "dtype": "bfloat16",
        "wrapped": "FSDP1 HYBRID_SHARD on (2, 2)",
        "tokens_per_s": tokens,
        "step_s": 0.5,
        "compute_s": 0.3,
        "exposed_s": {"all_gather": 0.05, "reduce_scatter": 0.05, "all_reduce": 0.1},
        "calls": {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 3},
        "async_calls": 0,
        "losses": losses,
    }


def test_the_table_holds_each_run_against_one_host_of_the_same_shape_and_gloo():
    same = [[9.0, 8.9]]
    per_layout = {
        "2x2": [_record("smddp", 1300, [[9.0, 8.91]]), _record("gloo", 1000, same)],
        "4x1": [_record("smddp", 900, [[9.0, 9.5]], replicas=4, shard=1)],
        "1x4": [
            _record("smddp", 1400, same),
            _record("gloo", 1250, same),
            _record("smddp", 1000, same, replicas=4, shard=1),
        ],
    }
    text = multihost_training_report.training_table(per_layout)
    lines = {tuple(c.strip() for c in line.split("|")[1:5]): line for line in text.splitlines()}
    smddp = lines[("2x2", "fsdp1_hybrid", "FSDP1 HYBRID_SHARD on (2, 2)", "smddp")]
    # of one host's 1300/1400, vs gloo 1300/1000, exposed 0.2 of 0.5, losses 0.01 apart.
    assert "| 1300 | 0.93 | 1.30 | 500 | 300 | 50 | 50 | 100 | 0.40 | 1.0e-02 |" in smddp
    far = lines[("4x1", "fsdp1_hybrid", "FSDP1 HYBRID_SHARD on (2, 2)", "smddp")]
    assert "| 900 | 0.90 | - |" in far and "6.0e-01 OVER" in far
    assert multihost_training_report.loss_problems(per_layout) == [
        "4x1 fsdp1_hybrid smddp bfloat16: losses differ from one host's by 6.00e-01, "
        "more than 2e-02"
    ]
    records = per_layout["2x2"]
    assert multihost_training_report.tokens_per_second(records, "fsdp1_hybrid", "gloo") == 1000
    with pytest.raises(KeyError, match="no fsdp2 run on smddp"):
        multihost_training_report.tokens_per_second(records, "fsdp2", "smddp")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "fp8"], "training dtype 'fp8': choose from float32, bfloat16"),
        (["--train-setups", "fsdp3"], "unknown ['fsdp3']; choose from fsdp2, fsdp1_hybrid"),
        (["--train", "--train-steps", "0"], "--train-steps 0: at least 1 timed step"),
    ],
)
def test_bad_training_arguments_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        multihost.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_training_dtype_takes_smps_spellings():
    assert multihost._train_dtype("bf16") == "bfloat16"
    assert multihost._train_dtype("BFloat16") == "bfloat16"
    assert multihost._train_dtype("fp32") == "float32"


def test_fsdp1_hybrid_with_one_rank_per_host_replicates_as_smps_plan_says():
    from torch.distributed.fsdp import ShardingStrategy

    from benchmarks.multihost_training import _plan

    # PyTorch would turn HYBRID_SHARD over a shard group of one into NO_SHARD over that
    # group (no synchronisation); the plan's hybrid_shard_degree=1 is NO_SHARD over replicas.
    placement = _plan(Run("fsdp1_hybrid", 4, 1)).fsdp1(ShardingStrategy.HYBRID_SHARD)
    assert (placement.strategy, placement.mesh) == (ShardingStrategy.NO_SHARD, "replicate_mesh")
    placement = _plan(Run("fsdp1_hybrid", 2, 2)).fsdp1(ShardingStrategy.HYBRID_SHARD)
    assert (placement.strategy, placement.mesh) == (ShardingStrategy.HYBRID_SHARD, "fsdp_mesh")
    assert _plan(Run("fsdp2_hybrid", 4, 1)).fsdp2_dense == "fsdp_mesh"
