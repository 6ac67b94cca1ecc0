"""Expert parallelism against one process on the concatenated global batch (issue: expert
parallelism).

Each case trains a tiny MoE model 2 AdamW steps under ``tsm.transform(model,
config=MoEConfig(...))`` and FSDP1 (exactly as SMP's scripts call it: transformer auto-wrap
policy, ``use_orig_params=True``, HYBRID_SHARD/FULL_SHARD, prefetching) or FSDP2
(``shard_model``), while every rank also trains an untransformed copy on every rank's batch.
Per step: the loss, the router logits (``output_router_logits=True``), every parameter's
unsharded gradient and the gradient norm of ``tsm.grad_norm.clip_grad_norm_`` must equal the
reference within fp32 tolerance, and after the last step every parameter. Several cases share
one launch (``moe_models.run_cases``).
"""

from __future__ import annotations

import pytest

from tests.distributed import moe_models as mm
from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp.backend import is_available as smddp_available

NONE = {"moe_load_balancing": "none", "moe_z_loss_coeff": 0.0}
ALL_GATHER = {**NONE, "moe_all_to_all_dispatcher": False}
AUX = {"moe_load_balancing": "aux_loss", "moe_aux_loss_coeff": 0.05, "moe_z_loss_coeff": 0.01}
EP2 = {"expert_parallel_degree": 2}
TP2_HSD2 = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}
TP2_HSD1 = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 1}
IDLE = {"implementation": "eager", "first_experts_only": True}


def _case(name, family, api, moe, extra=None, smp=None):
    return (name, family, api, moe, extra or {}, smp or EP2)


TWO_RANK_CASES = [
    # AdamW's foreach path, CUDA's default, in one case of each API (the others take the CPU's
    # single-tensor path): under FSDP1 the experts stay DTensors beside plain parameters (Note
    # [Optimizer steps over DTensor and plain parameters]); under FSDP2 the experts' DTensors
    # are on another mesh than the rest.
    _case("mixtral-fsdp1-a2a-foreach", "mixtral", "fsdp1", NONE, {"foreach": True}),
    _case("mixtral-fsdp1-allgather", "mixtral", "fsdp1", ALL_GATHER),
    _case("mixtral-fsdp2-a2a", "mixtral", "fsdp2", NONE),
    _case("mixtral-fsdp2-allgather", "mixtral", "fsdp2", ALL_GATHER),
    _case("qwen2_moe-fsdp1-a2a", "qwen2_moe", "fsdp1", NONE),
    _case("qwen2_moe-fsdp2-allgather", "qwen2_moe", "fsdp2", ALL_GATHER),
    _case("qwen3_moe-fsdp1-allgather", "qwen3_moe", "fsdp1", ALL_GATHER),
    _case("qwen3_moe-fsdp2-a2a-foreach", "qwen3_moe", "fsdp2", NONE, {"foreach": True}),
    # aux_loss (+ z-loss): the reference adds the same per-rank terms to each rank's loss.
    _case("mixtral-fsdp1-aux", "mixtral", "fsdp1", AUX),
    _case(
        "qwen3_moe-fsdp2-aux-allgather",
        "qwen3_moe",
        "fsdp2",
        {**AUX, "moe_all_to_all_dispatcher": False},
    ),
    # Sinkhorn and balanced routing (with z-loss): the reference is MoELayer in one process.
    _case(
        "mixtral-fsdp2-sinkhorn",
        "mixtral",
        "fsdp2",
        {"moe_load_balancing": "sinkhorn"},
        {"moe_ref": True},
    ),
    _case(
        "qwen3_moe-fsdp1-balanced-allgather",
        "qwen3_moe",
        "fsdp1",
        {"moe_load_balancing": "balanced", "moe_all_to_all_dispatcher": False},
        {"moe_ref": True},
    ),
    # The shuffle changes no token's result with "none" balancing, and the router logits that
    # Hugging Face records (and its aux loss) are the rank's own tokens in order (Note [Router
    # logits and the token shuffle]), also against a padding mask with other counts per rank.
    _case("mixtral-fsdp2-shuffle", "mixtral", "fsdp2", {**NONE, "global_token_shuffle": True}),
    _case(
        "qwen2_moe-fsdp1-shuffle-mask-uneven",
        "qwen2_moe",
        "fsdp1",
        {**NONE, "global_token_shuffle": True},
        {"mask": True, "rows": (3, 2)},
    ),
    # transformers' eager expert loop with every choice on EP rank 0's experts: EP rank 1
    # still gives its experts and inputs gradients, so both ranks run the same collectives
    # (Note [Experts without a token on this rank]; without it, each of these hung).
    _case("mixtral-fsdp1-eager-idle-a2a", "mixtral", "fsdp1", NONE, IDLE),
    _case("mixtral-fsdp2-eager-idle-allgather", "mixtral", "fsdp2", ALL_GATHER, IDLE),
    _case("qwen2_moe-fsdp2-eager-idle-a2a", "qwen2_moe", "fsdp2", NONE, IDLE),
    _case("qwen3_moe-fsdp1-eager-idle-allgather", "qwen3_moe", "fsdp1", ALL_GATHER, IDLE),
    # smp_moe=False: the Hugging Face block and router stay, only the experts are split.
    _case("mixtral-fsdp1-hf-block", "mixtral", "fsdp1", {**NONE, "smp_moe": False}),
    # Composition: checkpointing of decoder layers (reentrant, as SMP's scripts) or of MoELayer
    # (non-reentrant), and the offload wrapper. With the shuffle, two forwards run before one
    # backward: each recompute must deal out its own forward's tokens again (Note [Token
    # shuffle under recomputation]; test_expert_parallel_api.py compares per-rank gradients
    # with and without checkpointing for both kinds).
    # (Reentrant checkpointing runs the first forward without grad, so the logits Hugging Face
    # records for output_router_logits carry no gradient and its own aux loss would not
    # train the router: that case runs without output_router_logits.)
    _case(
        "mixtral-fsdp1-ckpt-layer-offload",
        "mixtral",
        "fsdp1",
        AUX,
        {"checkpoint": "layer", "offload": True, "router_logits": False},
    ),
    _case(
        "mixtral-fsdp2-ckpt-moe-shuffle-2fwd",
        "mixtral",
        "fsdp2",
        {**NONE, "global_token_shuffle": True},
        {"checkpoint": "moe", "router_logits": False, "microbatches": 2},
    ),
]


@pytest.mark.distributed
def test_ep2_on_two_ranks_matches_one_process():
    per_rank = run_distributed(mm.run_cases, TWO_RANK_CASES, world_size=2, timeout=900)
    for results in per_rank:
        mm.check(results)
    for name, r in per_rank[0].items():
        assert r["local_experts"] == [
            (2, 32, 24 if "qwen" in name else 48),
            (2, 48 if "qwen" in name else 96, 32),
        ], (name, r["local_experts"])
        assert r["loss"] != per_rank[1][name]["loss"], (name, "ranks must see different batches")


@pytest.mark.distributed
def test_moe_config_with_tp_over_all_ranks_under_fsdp1_no_shard_matches_one_process():
    """MoEConfig with tp 2 over both ranks, as SMP's scripts run Mixtral with --moe 1 and TP on
    a world of tp ranks: a shard group of one rank, so FSDP1 runs NO_SHARD (Note [FSDP1
    NO_SHARD with DTensor parameters]); the 4-rank cases run it with replicas."""
    case = _case(
        "tp2-mixtral-fsdp1-no-shard-aux", "mixtral", "fsdp1", AUX, smp={"tensor_parallel_degree": 2}
    )
    for results in run_distributed(mm.run_cases, [case], world_size=2, timeout=600):
        mm.check(results)


@pytest.mark.distributed
@pytest.mark.skipif(
    not smddp_available(), reason="torch_sagemaker._C was built without the smddp backend"
)
def test_ep2_dispatch_over_smddp():
    """Both dispatchers on smddp's all_to_all_single (uneven splits), all-gather and
    reduce-scatter."""
    cases = [
        _case("mixtral-fsdp2-a2a", "mixtral", "fsdp2", NONE),
        _case("qwen2_moe-fsdp1-allgather", "qwen2_moe", "fsdp1", ALL_GATHER),
    ]
    for results in run_distributed(mm.run_cases, cases, world_size=2, backend="smddp", timeout=600):
        mm.check(results)


FOUR_RANK_CASES = [
    # ep 2 x hybrid_shard_degree 2: experts sharded over the shard pair that holds them.
    _case(
        "ep2-hsd2-mixtral-fsdp1", "mixtral", "fsdp1", NONE, smp={**EP2, "hybrid_shard_degree": 2}
    ),
    _case(
        "ep2-hsd2-qwen2_moe-fsdp2-allgather",
        "qwen2_moe",
        "fsdp2",
        ALL_GATHER,
        smp={**EP2, "hybrid_shard_degree": 2},
    ),
    _case(
        "ep2-hsd2-mixtral-fsdp2-aux", "mixtral", "fsdp2", AUX, smp={**EP2, "hybrid_shard_degree": 2}
    ),
    # ep 2, hybrid_shard_degree 0 (FSDP1 FULL_SHARD): the dense shard group is the world,
    # the experts' is half of it; the gradient norm once deadlocked here (Note [One order of
    # groups on every rank] in grad_norm.py).
    _case(
        "ep2-hsd0-mixtral-fsdp1-aux", "mixtral", "fsdp1", AUX, smp={**EP2, "hybrid_shard_degree": 0}
    ),
    # ep 2 x hybrid_shard_degree 1: two replicas hold each expert (FSDP2 HSDP on the expert mesh).
    _case(
        "ep2-hsd1-mixtral-fsdp2", "mixtral", "fsdp2", NONE, smp={**EP2, "hybrid_shard_degree": 1}
    ),
    # MoEConfig with tensor parallelism (expert parallel degree 1), as SMP's scripts run Mixtral
    # with --moe 1 and tp 2: the TP plan splits the experts, MoELayer routes (Note [MoELayer
    # under tensor parallelism]). FSDP1 HYBRID_SHARD with aux and z losses; Sinkhorn routing
    # under reentrant checkpointing of the layers.
    _case("tp2-hsd2-mixtral-fsdp1-aux", "mixtral", "fsdp1", AUX, smp=TP2_HSD2),
    _case(
        "tp2-hsd2-mixtral-fsdp1-sinkhorn-ckpt",
        "mixtral",
        "fsdp1",
        {"moe_load_balancing": "sinkhorn"},
        {"moe_ref": True, "checkpoint": "layer", "router_logits": False},
        smp=TP2_HSD2,
    ),
    # The same with hybrid_shard_degree 1: FSDP1 NO_SHARD over two replicas.
    _case("tp2-hsd1-mixtral-fsdp1-no-shard-aux", "mixtral", "fsdp1", AUX, smp=TP2_HSD1),
    # ep 4: one expert per rank.
    _case("ep4-mixtral-fsdp1", "mixtral", "fsdp1", NONE, smp={"expert_parallel_degree": 4}),
    _case(
        "ep4-qwen3_moe-fsdp2-allgather",
        "qwen3_moe",
        "fsdp2",
        ALL_GATHER,
        smp={"expert_parallel_degree": 4},
    ),
]


@pytest.mark.distributed
def test_ep2_hsd2_and_ep4_on_four_ranks_match_one_process():
    per_rank = run_distributed(mm.run_cases, FOUR_RANK_CASES, world_size=4, timeout=900)
    for results in per_rank:
        mm.check(results)
    assert per_rank[0]["ep4-mixtral-fsdp1"]["local_experts"] == [(1, 32, 48), (1, 96, 32)]
