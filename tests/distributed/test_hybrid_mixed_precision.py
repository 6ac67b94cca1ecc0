"""bf16 mixed precision and activation checkpointing under hybrid sharding (issue: hybrid sharding).

4 ranks, hybrid_shard_degree=2 (two replicas of two shards), a tiny Llama trained 4 steps:
FSDP1 with SMP's example recipe ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16,
buffer_dtype=fp32)`` and FSDP2 ``shard_model`` with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, each with and without non-reentrant activation checkpointing
(``torch_sagemaker.sharding.checkpoint_transformer_layers``) on every decoder layer, applied
before wrapping (and, for FSDP1, also after it, the order of SMP's examples).

Checked on every rank: master parameters, gradients, optimizer state and buffers are fp32
(also the rotary ``inv_freq`` buffer as the forward sees it); the attention weights the
forward sees and every decoder layer's output are bf16; checkpointing wraps each layer once
and runs each layer's forward twice per step (forward and recomputation). Then parity:

- With checkpointing against the same run without: recomputation replays the same bf16
  kernels on the same all-gathered weights, so losses, norms and parameters are bit-equal.
- Against ``bf16_reference_run``, one process replaying the recipe per data-parallel rank
  (bf16 copies of the fp32 masters, fp32 buffers, gradients averaged in fp32). FSDP2 reduces
  in fp32 like the replay, so only the order of fp32 sums differs; FSDP1 reduces in bf16
  (2^-9 relative rounding per reduction), so its gradients are a little further off.
- Against ``reference_run`` (fp32, one process): bf16 compute moves the losses by ~2e-5
  relative and each parameter's update (final minus initial) by ~1.2%.

Tolerances are REPLAY_TOL / FP32_TOL below, a few times the measured deviations. They stay
discriminating: losses move by ~7e-3 relative from step to step, and FSDP2 sharding over the
shard axis only (replicas never synchronised) fails the loss check against the replay.
"""

import pytest
import torch

from tests.distributed.hf_models import (
    bf16_reference_run,
    full_params,
    global_batches,
    rank_slice,
    reference_run,
    tiny_llama,
)
from tests.distributed.launcher import run_distributed
from torch_sagemaker.smddp.backend import is_available as smddp_available

STEPS, GLOBAL_BATCH, LR, MAX_NORM, HSD, LAYERS = 4, 8, 0.1, 1.0, 2, 2
BACKENDS = [
    "gloo",
    pytest.param(
        "smddp",
        marks=pytest.mark.skipif(
            not smddp_available(), reason="torch_sagemaker._C was built without the smddp backend"
        ),
    ),
]
# ac: False, True (checkpoint, then wrap) or "after_wrap" (FSDP1 first: SMP examples' order).
CASES = [
    ("fsdp1", False),
    ("fsdp1", True),
    ("fsdp1", "after_wrap"),
    ("fsdp2", False),
    ("fsdp2", True),
]
# Against the bf16 replay, by API: (losses rtol, norms rtol, largest relative error of a
# parameter's update). Measured on gloo and smddp: FSDP2 6e-8, 2e-7, 4e-5 (fp32 sum order);
# FSDP1 3e-5, 9e-5, 7e-3 (bf16 reductions).
REPLAY_TOL = {"fsdp2": (2e-6, 2e-6, 5e-4), "fsdp1": (3e-4, 1e-3, 0.03)}
# Against fp32 (reference_run): measured 2e-5, 3e-4, 1.2e-2 for both APIs.
FP32_TOL = (5e-4, 5e-3, 0.05)


def _wrap(model, api, ac, device="cpu"):
    """Checkpointing, then bf16 FSDP1 / FSDP2 as the SMP examples spell them.

    On CUDA, FSDP1 gets ``device_id=torch.cuda.current_device()``, as SMP's scripts pass it.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from torch_sagemaker.sharding import (
        checkpoint_transformer_layers,
        shard_model,
        transformer_layer_classes,
    )

    if ac is True:
        checkpoint_transformer_layers(model)
    if api == "fsdp2":
        return shard_model(
            model,
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
    mixed = MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.float32
    )
    model = FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy(set(transformer_layer_classes(model))),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        mixed_precision=mixed,
        device_id=torch.cuda.current_device() if device == "cuda" else torch.device("cpu"),
        use_orig_params=True,
        limit_all_gathers=True,
    )
    if ac == "after_wrap":
        checkpoint_transformer_layers(model)
    return model


def _probe(model, seen):
    """Hooks recording the dtypes the forward computes in, and how often each layer runs."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    def layer_in(module, args):
        # A pre-hook: the recomputation stops early once it has rebuilt the last saved
        # tensor (torch.utils.checkpoint's early stop), so post-hooks see only the forward.
        seen["layer_calls"] += 1

    def layer_out(module, args, out):
        seen["activations"].add((out if torch.is_tensor(out) else out[0]).dtype)

    for m in model.modules():
        if isinstance(m, LlamaDecoderLayer):
            m.register_forward_pre_hook(layer_in)
            m.register_forward_hook(layer_out)
            m.self_attn.q_proj.register_forward_pre_hook(
                lambda mod, args: seen["weights"].add(mod.weight.dtype)
            )
        elif isinstance(m, LlamaRotaryEmbedding):
            m.register_forward_pre_hook(lambda mod, args: seen["inv_freq"].add(mod.inv_freq.dtype))


def _train(cases, device="cpu"):
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from torch_sagemaker.grad_norm import clip_grad_norm_

    if device == "cuda":  # the ranks share the GPUs round-robin (tests/gpu)
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    results = {}
    # One init for every case, as a job that builds models one after another: DTensor's
    # sharding caches stay warm (tsm.state.reset() empties them).
    tsm.state.reset()
    tsm.init({"hybrid_shard_degree": HSD})
    for api, ac in cases:
        model = _wrap(tiny_llama(), api, ac, device)
        seen = {"layer_calls": 0, "activations": set(), "weights": set(), "inv_freq": set()}
        _probe(model, seen)
        optim = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        losses, norms, grad_dtypes = [], [], set()
        for batch in global_batches(STEPS, GLOBAL_BATCH):
            local = rank_slice(batch, tsm.state.dp_rank, tsm.state.dp_size).to(device)
            loss = model(input_ids=local, labels=local).loss
            loss.backward()
            norms.append(float(clip_grad_norm_(model, MAX_NORM)))
            grad_dtypes |= {p.grad.dtype for p in model.parameters() if p.grad is not None}
            optim.step()
            optim.zero_grad(set_to_none=True)
            avg = loss.detach().float()
            dist.all_reduce(avg)
            losses.append(avg.item() / dist.get_world_size())
        dtypes = dict(
            params={p.dtype for p in model.parameters()},
            grads=grad_dtypes,
            buffers={b.dtype for b in model.buffers()},
            optim={t.dtype for s in optim.state.values() for t in s.values() if torch.is_tensor(t)},
            activations=seen["activations"],
            weights=seen["weights"],
            inv_freq=seen["inv_freq"],
        )
        wrappers = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
        results[(api, ac)] = dict(
            losses=losses,
            norms=norms,
            params={n: p.cpu() for n, p in full_params(model).items()},
            dtypes=dtypes,
            layer_calls=seen["layer_calls"],
            wrappers=wrappers,
        )
    return results


@pytest.fixture(scope="module")
def references():
    return (
        bf16_reference_run(STEPS, GLOBAL_BATCH, dp_size=4, lr=LR, max_norm=MAX_NORM),
        reference_run(STEPS, GLOBAL_BATCH, LR, MAX_NORM),
        {n: p.detach() for n, p in tiny_llama().named_parameters()},
    )


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_and_checkpointing_parity(backend, references):
    per_rank = run_distributed(_train, CASES, world_size=4, backend=backend, timeout=600)
    replay, fp32_ref, init = references
    check_parity(
        per_rank,
        [
            (replay, REPLAY_TOL, "bf16 replay"),
            (fp32_ref, {"fsdp1": FP32_TOL, "fsdp2": FP32_TOL}, "fp32"),
        ],
        init,
    )


def check_parity(per_rank, against, init, exact_checkpointing: bool = True) -> None:
    """Dtypes, checkpointing and parity of ``_train``'s results on every rank.

    Args:
        per_rank: ``_train``'s results by rank.
        against: ``(reference, tolerances by API, name)`` triples, each reference being
            ``(losses, norms, params)`` as ``reference_run`` returns them.
        init: The initial parameters (updates are compared, not values).
        exact_checkpointing: Whether a run with checkpointing must be bit-equal to the same run
            without (on CPU; on CUDA a backward kernel may sum in another order per call).
    """
    fp32, bf16 = torch.float32, torch.bfloat16
    for rank, results in enumerate(per_rank):
        for (api, ac), r in results.items():
            where = f"{api} ac={ac} rank {rank}"
            # fp32 master weights, gradients, optimizer state and buffers; bf16 compute.
            d = r["dtypes"]
            assert d["params"] == d["grads"] == d["optim"] == d["buffers"] == {fp32}, (where, d)
            assert d["inv_freq"] == {fp32}, (where, d)  # buffer_dtype=fp32 / FSDP2 leaves buffers
            assert d["weights"] == d["activations"] == {bf16}, (where, d)
            # Checkpointing wraps each layer once and recomputes each layer's forward in backward.
            assert r["wrappers"] == (LAYERS if ac else 0), where
            assert r["layer_calls"] == STEPS * LAYERS * (2 if ac else 1), where
            if ac and exact_checkpointing and (api, False) in results:
                plain = results[(api, False)]  # bit-identical to the same run without
                assert r["losses"] == plain["losses"] and r["norms"] == plain["norms"], where
                for name, value in r["params"].items():
                    assert torch.equal(value, plain["params"][name]), (where, name)
            for ref, tolerances, what in against:
                loss_rtol, norm_rtol, update_rel = tolerances[api]
                ref_losses, ref_norms, ref_params = ref
                torch.testing.assert_close(
                    r["losses"],
                    ref_losses,
                    rtol=loss_rtol,
                    atol=0,
                    msg=f"{where}: losses vs {what}",
                )
                torch.testing.assert_close(
                    r["norms"], ref_norms, rtol=norm_rtol, atol=0, msg=f"{where}: norms vs {what}"
                )
                assert r["params"].keys() == ref_params.keys(), where
                for name, value in r["params"].items():
                    assert value.dtype == fp32, (where, name)
                    update, ref_update = value - init[name], ref_params[name] - init[name]
                    rel = float((update - ref_update).norm() / ref_update.norm())
                    assert rel < update_rel, f"{where}: {name} update off by {rel:.2e} vs {what}"
