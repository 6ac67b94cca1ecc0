"""Prefetching offload under FSDP2, FSDP1, tensor parallelism (tp=2) and DTensor saves.

Every case builds the same model twice on each rank, once with offloading and once without,
and requires the loss and every (full) gradient to be bit-identical. PyTorch's
offload-everything wrapper (``sm_activation_offloading`` false, or a model without layers to
prefetch for) is held to the same under tensor parallelism and on DTensor saves. All cases
run in one launch of 2 ranks over gloo to keep start-up cost down.
"""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_distributed

N_LAYERS = 4


def _llama(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    return LlamaForCausalLM(cfg)


def _checkpoint(model) -> None:
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    apply_activation_checkpointing(
        model,
        check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
        checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
    )


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(model, rank: int, autocast: bool = False):
    """Loss and full gradients (by unwrapped name) of one step on this rank's batch."""
    import contextlib

    import torch

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")
        # FSDP1 (use_orig_params) leaves None where this rank holds no part of a parameter.
        grads[name] = torch.empty(0) if p.grad is None else _full(p.grad).clone()
    return loss.detach(), grads


def _compare(on, off) -> dict:
    (loss_on, grads_on), (loss_off, grads_off) = on, off
    return dict(
        loss_equal=bool(torch_equal(loss_on, loss_off)),
        names_equal=sorted(grads_on) == sorted(grads_off),
        unequal=[n for n in grads_off if not torch_equal(grads_on[n], grads_off[n])],
        nonzero=all(bool(g.abs().sum() > 0) for g in grads_off.values() if g.numel()),
    )


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def _offload(model, **kwargs):
    from torch_sagemaker.offload import PrefetchOffloadWrapper

    return PrefetchOffloadWrapper(model, horizon=1, min_offload_bytes=0, **kwargs)


def _fsdp2_case(rank: int, mixed: bool) -> dict:
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torch_sagemaker.offload import get_stats

    def build():
        model = _llama()
        _checkpoint(model)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed else MixedPrecisionPolicy()
        for m in model.modules():
            if isinstance(m, CheckpointWrapper):
                fully_shard(m, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model

    off = _step(build(), rank)
    wrapped = _offload(build())
    result = _compare(_step(wrapped, rank), off)
    stats = get_stats(wrapped)
    result.update(offloaded=stats.bytes_offloaded, demand=stats.demand_fetches, layers=stats.layers)
    return result


def _fsdp1_case(rank: int) -> dict:
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from torch_sagemaker.offload import get_stats

    def build():
        # The order of SMP's FSDP1 examples: wrap, then checkpoint the wrapped layers.
        model = FSDP(
            _llama(),
            auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        _checkpoint(model)
        return model

    off = _step(build(), rank)
    wrapped = _offload(build())
    on = _step(wrapped, rank)
    # FSDP1 keeps sharded gradients: compare this rank's shards.
    result = _compare(on, off)
    result.update(offloaded=get_stats(wrapped).bytes_offloaded)
    return result


def _dtensor_case() -> dict:
    """A layer that saves a DTensor: the local shard is offloaded and rebuilt."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import torch_sagemaker as tsm
    from torch_sagemaker.offload import NativeOffloadWrapper, get_stats

    class Layer(nn.Module):
        def forward(self, x):
            return (x * 2).sin()  # sin saves its (DTensor) input

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    mesh = init_device_mesh("cpu", (2,))
    results = []
    for offload in ("prefetch", "fallback", None):
        full = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
        x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        model = Stack()
        if offload == "prefetch":
            model = _offload(model, layers=lambda m: isinstance(m, Layer))
        elif offload == "fallback":  # no layers it knows: PyTorch's wrapper, saving DTensors
            model = tsm.offload_wrapper(model)
        out = model(x)
        out.sum().backward()
        results.append(
            (
                out.full_tensor(),
                x.grad.full_tensor(),
                get_stats(model).bytes_offloaded if offload == "prefetch" else type(model),
            )
        )
    (out_on, grad_on, offloaded), (out_fb, grad_fb, fallback), (out_off, grad_off, _) = results
    return dict(
        out_equal=torch.equal(out_on, out_off),
        grad_equal=torch.equal(grad_on, grad_off),
        offloaded=offloaded,
        local_bytes=3 * 4 * 16 * 4,
        fallback_native=fallback is NativeOffloadWrapper,
        fallback_equal=torch.equal(out_fb, out_off) and torch.equal(grad_fb, grad_off),
    )


def _tp_case(rank: int) -> dict:
    """tsm.init(tp=2) + tsm.transform, offload_wrapper imported from PyTorch's module."""
    import torch.sagemaker as tsm
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    from tests.distributed.test_delayed_param import fresh_layout
    from torch_sagemaker.offload import NativeOffloadWrapper, PrefetchOffloadWrapper, get_stats

    tsm.init({"tensor_parallel_degree": 2, "activation_loading_horizon": 2})

    def build():
        model = tsm.transform(_llama())
        _checkpoint(model)
        return model

    off = _step(build(), 0)  # the TP group shares one batch
    wrapped = cw.offload_wrapper(build())  # the SMP script path
    result = _compare(_step(wrapped, 0), off)
    stats = get_stats(wrapped)
    result.update(
        prefetching=isinstance(wrapped, PrefetchOffloadWrapper),
        horizon=wrapped._offload_engine.horizon,
        offloaded=stats.bytes_offloaded,
        demand=stats.demand_fetches,
        lead=stats.prefetch_lead_max,
    )
    bf16_off = _step(build(), 0, autocast=True)
    bf16 = _compare(_step(cw.offload_wrapper(build()), 0, autocast=True), bf16_off)
    result["bf16_unequal"] = bf16["unequal"] + ([] if bf16["loss_equal"] else ["loss"])
    # With offloading switched off in the config, PyTorch's wrapper comes back, as a subclass
    # that also saves DTensors (PyTorch's own failed on them at the first forward: Note
    # [DTensors under PyTorch's offload wrapper]).
    fresh_layout({"tensor_parallel_degree": 2, "sm_activation_offloading": False})
    native = cw.offload_wrapper(build())
    result["native_when_off"] = type(native) is NativeOffloadWrapper
    result["native"] = _compare(_step(native, 0), off)
    return result


def _all_cases() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    return dict(
        fsdp2=_fsdp2_case(rank, mixed=False),
        fsdp2_bf16=_fsdp2_case(rank, mixed=True),
        fsdp1=_fsdp1_case(rank),
        dtensor=_dtensor_case(),
        tp=_tp_case(rank),
    )


@pytest.mark.distributed
def test_offload_is_bit_identical_under_fsdp_tp_and_dtensor():
    for r in run_distributed(_all_cases, world_size=2, timeout=400):
        for name in ("fsdp2", "fsdp2_bf16", "fsdp1", "tp"):
            case = r[name]
            assert case["loss_equal"] and case["names_equal"], (name, case)
            assert case["unequal"] == [], (name, case["unequal"])
            assert case["nonzero"] and case["offloaded"] > 0, (name, case)
        for name in ("fsdp2", "fsdp2_bf16"):
            assert r[name]["layers"] == N_LAYERS and r[name]["demand"] == 0, r[name]
        dt = r["dtensor"]
        assert dt["out_equal"] and dt["grad_equal"], dt
        assert dt["offloaded"] == dt["local_bytes"], dt  # the local shards, not full tensors
        assert dt["fallback_native"] and dt["fallback_equal"], dt
        tp = r["tp"]
        assert tp["prefetching"] and tp["horizon"] == 2 and tp["demand"] == 0, tp
        assert tp["lead"] == 2 and tp["bf16_unequal"] == [], tp
        assert tp["native_when_off"], tp
        native = tp["native"]
        assert native["loss_equal"] and native["unequal"] == [] and native["nonzero"], native
