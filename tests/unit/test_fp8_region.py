"""FP8 layers next to their surroundings: torch.compile, Transformer Engine's region and
layers, and which layers ``tsm.transform``'s FP8 step builds.

Transformer Engine is not installed here: its modules are stood in for by small objects in
``sys.modules`` with the attributes this package reads (``FP8GlobalStateManager``,
``fp8_autocast``, ``Linear``, recipe classes from ``transformer_engine.common.recipe``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
import types

import pytest
import torch
from torch import nn

from torch_sagemaker.fp8 import (
    DelayedScaling,
    Fp8Linear,
    fp8_autocast,
    get_fp8_recipe,
    linear,
    te_bridge,
    to_fp8_linear,
)
from torch_sagemaker.fp8.prepare import prepare_linears
from torch_sagemaker.policies import lookup_policy

# The module of the region (the package's ``autocast`` attribute is the function).
region = importlib.import_module("torch_sagemaker.fp8.autocast")


def _tiny_llama(**kw):
    from tests.distributed.hf_models import tiny_llama

    return tiny_llama(num_hidden_layers=1, **kw)


def test_transformed_model_compiles_with_fullgraph(monkeypatch):
    """Note [FP8 layers under torch.compile]: until a script enters an FP8 region, the FP8
    layers are nn.Linear to Dynamo too, so a script that never uses FP8 compiles as before
    (the autograd engine query of the FP8 path would break the graph at every layer)."""
    monkeypatch.setattr(region, "_ENTERED", False)  # as in a process that never used FP8
    model = _tiny_llama()
    report = prepare_linears(model, lookup_policy(model), backend="dtensor", tp=1)
    assert len(report.layers) == 7
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
    finally:
        torch._dynamo.reset()
    assert torch.equal(out.logits, model(input_ids=ids).logits)


class _Manager:
    enabled = False

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.enabled


@pytest.fixture
def te_stub(monkeypatch):
    """Transformer Engine's packages as this package reads them; returns the recorder."""
    calls: list[dict] = []

    @contextlib.contextmanager
    def fp8_autocast(**kwargs):
        calls.append(kwargs)
        _Manager.enabled = kwargs["enabled"]
        try:
            yield
        finally:
            _Manager.enabled = False

    class Linear(nn.Module):  # te.Linear's constructor as tensor_parallel/te.py calls it
        def __init__(self, in_features, out_features, *, bias, params_dtype, device, **_):
            super().__init__()
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=params_dtype, device=device)
            )
            self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    Linear.__module__ = "transformer_engine.pytorch.module.linear"
    root = types.ModuleType("transformer_engine")
    torch_pkg = types.ModuleType("transformer_engine.pytorch")
    quantization = types.ModuleType("transformer_engine.pytorch.quantization")
    torch_pkg.fp8_autocast, torch_pkg.Linear = fp8_autocast, Linear
    torch_pkg.quantization = quantization
    quantization.FP8GlobalStateManager = _Manager
    root.pytorch = torch_pkg
    for name, module in (
        ("transformer_engine", root),
        ("transformer_engine.pytorch", torch_pkg),
        ("transformer_engine.pytorch.quantization", quantization),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(_Manager, "enabled", False)
    # Which layers exist is process state: each test starts with none and leaves it as it was.
    monkeypatch.setattr(te_bridge, "_TE_LAYERS_BUILT", False)
    monkeypatch.setattr(te_bridge, "_NATIVE_LAYERS_BUILT", False)
    monkeypatch.setattr(region, "_ENTERED", region._ENTERED)
    return calls


def _te_recipe(kind: str):
    cls = type(kind, (), {"__module__": "transformer_engine.common.recipe"})
    return cls()


def test_te_region_around_our_layers_warns_once(te_stub, monkeypatch):
    """SMP's script unchanged (Transformer Engine's fp8_autocast) over our layers: they would
    silently compute in high precision; the first forward warns, naming the fix."""
    warned: list[str] = []
    monkeypatch.setattr(linear, "warn_once", warned.append)
    layer = to_fp8_linear(nn.Linear(16, 8))
    x = torch.randn(2, 16)
    import transformer_engine.pytorch as te

    for ever_entered in (False, True):  # before and after our own region was first used
        monkeypatch.setattr(region, "_ENTERED", ever_entered)
        layer(x)
        assert warned == []  # no region at all
        with te.fp8_autocast(enabled=True, fp8_recipe=None):
            assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
        assert warned == [linear._TE_REGION_WARNING], ever_entered
        assert "torch.sagemaker.fp8.fp8_autocast" in warned[0]
        warned.clear()
    with fp8_autocast(enabled=True):  # ours: FP8, no warning
        layer(x)
    assert warned == []


def test_te_recipes_go_through_where_only_te_layers_exist(te_stub):
    """A Transformer Engine recipe this package does not implement (MXFP8) is Transformer
    Engine's business where every FP8 layer is Transformer Engine's; with our layers it is
    refused, naming it."""
    mxfp8 = _te_recipe("MXFP8BlockScaling")
    te_bridge.note_te_layers()
    with fp8_autocast(enabled=True, fp8_recipe=mxfp8):
        assert get_fp8_recipe() is mxfp8
        layer = to_fp8_linear(nn.Linear(16, 8))  # ours appear inside: refused when they run
        with pytest.raises(ValueError, match="MXFP8BlockScaling"):
            layer(torch.randn(2, 16))
    assert te_stub == [dict(enabled=True, calibrating=False, fp8_recipe=mxfp8, fp8_group=None)]
    with pytest.raises(ValueError, match="MXFP8BlockScaling"), fp8_autocast(fp8_recipe=mxfp8):
        pass  # our layers exist now: refused before either region is entered
    assert len(te_stub) == 1


def test_te_layers_at_degree_1_only_when_asked_for(te_stub):
    """tensor_parallel_degree 1: our Fp8Linear unless the script called use_backend("te")
    (``backend_forced``), and then only from CUDA or meta parameters."""
    base = _tiny_llama()
    policy = lookup_policy(base)
    model = copy.deepcopy(base)
    report = prepare_linears(model, policy, backend="te", tp=1, backend_forced=False)
    assert report.kind == "native" and len(report.layers) == 7
    assert isinstance(model.model.layers[0].mlp.up_proj, Fp8Linear)
    assert not te_bridge._TE_LAYERS_BUILT
    with pytest.raises(ValueError, match=r"q_proj' is on cpu.*device='cuda'"):
        prepare_linears(copy.deepcopy(base), policy, backend="te", tp=1, backend_forced=True)
    with torch.device("meta"):
        meta = _tiny_llama()
    report = prepare_linears(meta, policy, backend="te", tp=1, backend_forced=True)
    assert report.kind == "te" and len(report.layers) == 7
    q_proj = meta.model.layers[0].self_attn.q_proj
    assert type(q_proj).__module__.startswith("transformer_engine") and q_proj.weight.is_meta
    assert te_bridge.only_te_layers() is False  # ours were built above in this process


def test_scaling_state_is_a_checkpoint_item_of_its_own(tmp_path):
    """TrainingState saves the FP8 layers' histories and scales as an item beside the model
    (whose keys stay nn.Linear's) and loads them into layers that have not run yet, so a
    resumed run quantizes with the scales the run it continues would have used."""
    from torch_sagemaker.checkpoint import TrainingState
    from torch_sagemaker.fp8 import load_scaling_state_dict, scaling_state_dict

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    model, fresh = copy.deepcopy(plain), copy.deepcopy(plain)
    for m in (model, fresh):
        to_fp8_linear(m[0]), to_fp8_linear(m[2])
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(4, 16) * 3
    for _ in range(2):
        with fp8_autocast(fp8_recipe=recipe):
            y = model(x)
        y.sum().backward()
    assert not torch.all(model[0].fp8_scaling.scale == 1)  # something to restore
    assert list(model.state_dict()) == list(plain.state_dict())
    assert sorted(scaling_state_dict(model)) == [
        "0.amax_history",
        "0.scale",
        "2.amax_history",
        "2.scale",
    ]
    TrainingState(model, save_rng=False).save(tmp_path / "ckpt")
    TrainingState(fresh, save_rng=False).load(tmp_path / "ckpt")
    for a, b in ((model[0], fresh[0]), (model[2], fresh[2])):
        assert torch.equal(a.fp8_scaling.history, b.fp8_scaling.history)
        assert torch.equal(a.fp8_scaling.scale, b.fp8_scaling.scale)
    with fp8_autocast(fp8_recipe=recipe):
        assert torch.equal(model(x), fresh(x))
    with pytest.raises(ValueError, match="'0'.*another model"):
        load_scaling_state_dict(plain, scaling_state_dict(model))


@pytest.mark.parametrize("nesting", ["inference_mode_outside", "inference_mode_inside"])
def test_an_inference_mode_evaluation_leaves_training_as_no_grad_does(nesting):
    # Note [Scaling state outside inference mode]: the state made under inference mode was
    # inference tensors, and the next training step failed on its in-place amax record.
    recipe = DelayedScaling(amax_history_len=4)

    def run(evaluation):
        torch.manual_seed(0)
        layer = to_fp8_linear(nn.Linear(16, 16))
        x = torch.randn(4, 16)
        for step in range(3):
            if step == 1:
                with evaluation():
                    layer(x)
            with fp8_autocast(fp8_recipe=recipe):
                y = layer(x.clone().requires_grad_())
            y.sum().backward()
        return layer.fp8_scaling.scale.clone(), layer.fp8_scaling.history.clone()

    @contextlib.contextmanager
    def no_grad_eval():
        with torch.no_grad(), fp8_autocast(fp8_recipe=recipe):
            yield

    @contextlib.contextmanager
    def inference_eval():
        if nesting == "inference_mode_outside":
            with torch.inference_mode(), fp8_autocast(fp8_recipe=recipe):
                yield
        else:
            with fp8_autocast(fp8_recipe=recipe), torch.inference_mode():
                yield

    (scale, history), (ref_scale, ref_history) = run(inference_eval), run(no_grad_eval)
    assert not scale.is_inference() and not history.is_inference()
    assert torch.equal(scale, ref_scale) and torch.equal(history, ref_history)
