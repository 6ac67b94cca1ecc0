"""Tied weights under tensor parallelism with FSDP1 and FSDP2, against one process.

Models with ``tie_word_embeddings=True`` (a tiny Qwen2 and a tiny Llama, as Llama 3.2 1B/3B
are) use one parameter as the input embedding and the LM head. Each rank keeps an
untransformed copy as the reference and trains it on the global batch. The transformed model
is wrapped with FSDP1 as SMP's example scripts wrap it (``tests/distributed/smp_script_steps.py``:
``use_orig_params=True``, ``TransformerLayer`` auto-wrap, ``HYBRID_SHARD``, reentrant
activation checkpointing) and with FSDP2 (``fully_shard`` per layer and on the root), and must
match the reference in logits, loss, gradients (the tied weight's is the sum of both uses),
losses and parameters over STEPS AdamW steps, and keep the tie: one parameter object under
both names, equal values on every rank, in the full state dict, and after a round trip
through SMP's ``sharded`` checkpoint type (Note [Tied DTensor parameters under FSDP1] in
torch_sagemaker/sharding/fsdp1_tied.py).

One launch of 4 ranks runs two layouts, one family each (Qwen2 and Llama share the TP plan
of the embedding and the head, so each layout needs one): tp 2 x hybrid_shard_degree 1 with
Llama (FSDP1 ``NO_SHARD`` over a shard group of one rank, as tp 2 on 2 ranks, plus a
data-parallel replica) and tp 2 x hybrid_shard_degree 2 with Qwen2 (FSDP1 shards the flat
parameters over two ranks; this layout also runs FSDP2 and the checkpoint round trip).
"""

from __future__ import annotations

import copy

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.test_tp_parity import ATOL, PARAM_ATOL, batch, build, max_diff

LAYOUTS = {  # name: (SMP config, family, FSDP2 and checkpoint round trip too)
    "tp2_hsd1": ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 1}, "llama", False),
    "tp2_hsd2": ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, "qwen2", True),
}
# Not tp2_hsd1 for the checkpoint round trip: there FSDP1's ``model.process_group`` (the
# scripts' checkpoint group) is the replica group of the NO_SHARD all-reduce, of which the
# scripts let only replica 0 write, so their save waits for the other replica (a separate
# issue of that layout, with or without tied weights). FSDP2 over a shard group of one rank
# would check nothing more than tp2_hsd2 does.
STEPS = 3
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _tied(model) -> bool:
    """Whether the embedding and the head hold one parameter object (through any wrapper)."""
    embed = model.get_input_embeddings().weight
    return embed is model.get_output_embeddings().weight


def _reference(ref, batches: list) -> dict:
    """The reference's step-0 logits and gradients, losses and final parameters.

    It trains on every data-parallel rank's batch (the mean of their losses), which is what
    data parallelism computes.
    """
    from tests.distributed import smp_script_steps as smp

    optimizer, scheduler = smp.optimizer_and_scheduler(ref)
    out: dict = {"losses": []}
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for ids in batches:
            o = ref(input_ids=ids, labels=ids, use_cache=False)
            (o.loss / len(batches)).backward()
            if step == 0:
                out.setdefault("logits", []).append(o.logits.detach())
            out["losses"].append(float(o.loss))
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in ref.named_parameters()}
        optimizer.step()
        scheduler.step()
    out["params"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return out


def _train(model, batches: list, dp_rank: int, grads_fn) -> tuple[dict, object, object]:
    """STEPS steps on this rank's batch; step 0's logits, loss and gradients (``grads_fn``)."""
    from tests.distributed import smp_script_steps as smp

    optimizer, scheduler = smp.optimizer_and_scheduler(model)
    ids = batches[dp_rank]
    out: dict = {"losses": []}
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        o = model(input_ids=ids, labels=ids, use_cache=False)
        o.loss.backward()
        if step == 0:
            out["logits"] = _full(o.logits)
            out["grads"] = grads_fn(model)
        out["losses"].append(float(o.loss))
        optimizer.step()
        scheduler.step()
    out["optimizer_params"] = sum(len(g["params"]) for g in optimizer.param_groups)
    return out, optimizer, scheduler


def _fsdp1_values(model, placements: dict, grads: bool = False) -> dict:
    """Full parameters (or gradients) under their Hugging Face names, the tied one's under both.

    Under ``NO_SHARD`` each parameter is the TP-local tensor, and so is its gradient (Note
    [FSDP1 NO_SHARD with DTensor parameters]): they are put together with the placements
    ``tsm.transform`` gave. The sharded strategies gather them with ``summon_full_params``.
    (Under ``NO_SHARD`` that gives the same local parameters, and with ``with_grads=True``
    gradients of the TP-global shape on them, which cannot be read back.)
    """
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.tensor import DTensor

    def value(p):
        return p.grad if grads else p

    if model.sharding_strategy is ShardingStrategy.NO_SHARD:
        return {
            _clean(n): DTensor.from_local(
                value(p).detach(), tsm.state.tp_mesh, placements[_clean(n)], run_check=False
            ).full_tensor()
            for n, p in model.named_parameters(remove_duplicate=False)
        }
    with FSDP.summon_full_params(model, with_grads=grads):
        return {
            _clean(n): _full(value(p)) for n, p in model.named_parameters(remove_duplicate=False)
        }


def _full_state_dict(model) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.api import FullStateDictConfig

    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=False, offload_to_cpu=False),
    ):
        return {k: v.clone() for k, v in model.state_dict().items() if k in (EMBED, HEAD)}


def _sharded_state_dict(model) -> dict:
    """This rank's pieces of the tied weight in FSDP1's sharded state dict."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.tensor import DTensor

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = model.state_dict()
    return {
        k: (v.to_local() if isinstance(v, DTensor) else v).clone()
        for k, v in state_dict.items()
        if k in (EMBED, HEAD)
    }


def _fsdp1_case(ref0, batches, dp_rank: int, root: str | None) -> dict:
    """FSDP1 as SMP's scripts wrap it; with ``root``, a ``sharded`` checkpoint round trip."""
    import torch.sagemaker as tsm

    from tests.distributed import smp_script_steps as smp

    model = tsm.transform(copy.deepcopy(ref0))
    r: dict = {"tied_after_transform": _tied(model)}
    placements = {n: p.placements for n, p in model.named_parameters(remove_duplicate=False)}
    model = smp.wrap_fsdp1(model, None, bf16=False)
    r["strategy"] = model.sharding_strategy.name
    r["tied_after_wrap"] = _tied(model.module)
    trained, optimizer, scheduler = _train(
        model, batches, dp_rank, lambda m: _fsdp1_values(m, placements, grads=True)
    )
    r |= trained
    r["tied_after_steps"] = _tied(model.module)
    r["params"] = _fsdp1_values(model, placements)
    r["full_state_dict"] = _full_state_dict(model)
    r["sharded_state_dict"] = _sharded_state_dict(model)
    if root is not None:
        meta = smp.pg_metadata(model)
        smp.save_sharded(model, optimizer, scheduler, root, meta, {"total_steps": STEPS})
        other = build(ref0.config.model_type, seed=1, tie_word_embeddings=True)
        loaded = smp.wrap_fsdp1(tsm.transform(other), None, bf16=False)
        loaded_optimizer, loaded_scheduler = smp.optimizer_and_scheduler(loaded)
        smp.load_sharded(loaded, loaded_optimizer, loaded_scheduler, root, smp.pg_metadata(loaded))
        r["tied_after_load"] = _tied(loaded.module)
        r["loaded_params"] = _fsdp1_values(loaded, placements)
        # One more step from the live model and from the checkpoint (its optimizer state
        # included): the same loss and the same weights after it.
        ids = batches[dp_rank]
        for key, m, opt in (("next", model, optimizer), ("next_loaded", loaded, loaded_optimizer)):
            opt.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            r[f"{key}_loss"] = float(loss)
            r[f"{key}_params"] = _fsdp1_values(m, placements)
    return r


def _fsdp2_case(ref0, batches, dp_rank: int) -> dict:
    """``fully_shard`` per transformer layer and on the root, over the data-parallel mesh."""
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import fully_shard

    from torch_sagemaker.policies import transformer_layer_classes

    model = tsm.transform(copy.deepcopy(ref0))
    layer_classes = transformer_layer_classes(model)
    for module in model.modules():
        if isinstance(module, layer_classes):
            fully_shard(module, mesh=tsm.state.fsdp_mesh)
    fully_shard(model, mesh=tsm.state.fsdp_mesh)
    r: dict = {"tied_after_wrap": _tied(model)}
    trained, _, _ = _train(
        model,
        batches,
        dp_rank,
        lambda m: {_clean(n): _full(p.grad) for n, p in m.named_parameters(remove_duplicate=False)},
    )
    r |= trained
    r["tied_after_steps"] = _tied(model)
    r["params"] = {_clean(n): _full(p) for n, p in model.named_parameters(remove_duplicate=False)}
    return r


def _tied_weights_in_layout(config: dict, family: str, root: str | None) -> dict:
    """Reference, FSDP1 (and with ``root`` FSDP2 and the checkpoint) on one layout."""
    import torch.sagemaker as tsm

    tsm.state.reset()  # the layouts follow one another in one call
    tsm.init(config)
    dp_rank, dp_size = tsm.state.dp_rank, tsm.state.dp_size
    batches = [batch(d) for d in range(dp_size)]
    ref0 = build(family, tie_word_embeddings=True)
    ref = copy.deepcopy(ref0)
    results: dict = {
        "dp": (dp_rank, dp_size),
        "ref_tied": _tied(ref),
        "reference": _reference(ref, batches),
        "fsdp1": _fsdp1_case(ref0, batches, dp_rank, root),
    }
    if root is not None:
        results["fsdp2"] = _fsdp2_case(ref0, batches, dp_rank)
    return results


def _tied_weights_all_layouts(root: str) -> dict:
    return {
        name: _tied_weights_in_layout(config, family, root if both else None)
        for name, (config, family, both) in LAYOUTS.items()
    }


def _check_run(where: str, run: dict, ref: dict, dp_rank: int, dp_size: int) -> None:
    import torch

    assert run["tied_after_wrap"] and run["tied_after_steps"], where
    assert run["optimizer_params"] == len(ref["params"]), (where, run["optimizer_params"])
    assert max_diff(run["logits"], ref["logits"][dp_rank]) < ATOL, where
    ref_losses = ref["losses"][dp_rank::dp_size]
    assert abs(run["losses"][0] - ref_losses[0]) < ATOL, (where, run["losses"], ref_losses)
    for a, b in zip(run["losses"], ref_losses, strict=True):
        assert abs(a - b) < 1e-4, (where, run["losses"], ref_losses)
    # Full names (the tied weight under both); its gradient is the sum of both uses.
    assert run["grads"].keys() == {*ref["grads"], HEAD}, where
    bad = {
        n: max_diff(g, ref["grads"].get(n, ref["grads"][EMBED])) for n, g in run["grads"].items()
    }
    assert max(bad.values()) < ATOL, (where, bad)
    assert torch.equal(run["grads"][EMBED], run["grads"][HEAD]), where
    # The weights after the steps: the tie is exact, the rest within Adam's rounding.
    assert torch.equal(run["params"][EMBED], run["params"][HEAD]), where
    drift = {
        n: max_diff(p, ref["params"].get(n, ref["params"][EMBED])) for n, p in run["params"].items()
    }
    assert max(drift.values()) < PARAM_ATOL, (where, drift)


@pytest.mark.distributed
def test_tied_weights_stay_tied_and_match_one_process(tmp_path):
    import torch

    per_rank = run_distributed(
        _tied_weights_all_layouts, str(tmp_path), world_size=4, backend="smddp", timeout=600
    )
    strategies = {"tp2_hsd1": "NO_SHARD", "tp2_hsd2": "HYBRID_SHARD"}
    for rank, layouts in enumerate(per_rank):
        for layout, r in layouts.items():
            where = f"{layout} rank {rank}"
            dp_rank, dp_size = r["dp"]
            assert (dp_rank, dp_size) == (rank // 2, 2), where
            assert r["ref_tied"], where
            ref = r["reference"]
            one = r["fsdp1"]
            assert one["tied_after_transform"], where
            assert one["strategy"] == strategies[layout], (where, one["strategy"])
            _check_run(f"{where} fsdp1", one, ref, dp_rank, dp_size)
            # Full state dict: both Hugging Face keys, the same values as the parameters.
            full = one["full_state_dict"]
            assert full.keys() == {EMBED, HEAD}, (where, full.keys())
            assert torch.equal(full[EMBED], full[HEAD]), where
            assert torch.equal(full[EMBED], one["params"][EMBED]), where
            # Sharded state dict: this rank's piece of the tied weight (under both keys if
            # FSDP1 writes both, then equal).
            sharded = one["sharded_state_dict"]
            assert EMBED in sharded, (where, sharded.keys())
            if HEAD in sharded:
                assert torch.equal(sharded[EMBED], sharded[HEAD]), where
            if LAYOUTS[layout][2]:
                _check_run(f"{where} fsdp2", r["fsdp2"], ref, dp_rank, dp_size)
                assert one["tied_after_load"], where
                loaded = one["loaded_params"]
                assert loaded.keys() == one["params"].keys(), where
                for name, value in loaded.items():
                    assert torch.equal(value, one["params"][name]), (where, name)
                assert one["next_loaded_loss"] == one["next_loss"], where
                for name, value in one["next_loaded_params"].items():
                    assert torch.equal(value, one["next_params"][name]), (where, name)
                assert torch.equal(one["next_params"][EMBED], one["next_params"][HEAD]), where
    # Every rank holds the same tied weight (TP ranks gather the same full tensor; replicas
    # and shard groups agree).
    for layout in LAYOUTS:
        first = per_rank[0][layout]["fsdp1"]["params"][EMBED]
        for rank in range(1, 4):
            other = per_rank[rank][layout]["fsdp1"]["params"][EMBED]
            assert torch.equal(first, other), (layout, rank)
