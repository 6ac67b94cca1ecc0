"""DelayedParamIniter and module_utils in one process (no FSDP): values, order, ties, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_sagemaker.delayed_param import DelayedParamIniter
from torch_sagemaker.utils.module_utils import (
    empty_module_params,
    move_buffers_to_device,
    to_empty_keeping_ties,
)
from torch_sagemaker.utils.process_group_utils import get_global_ranks

CFG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=128,
    max_position_embeddings=64,
    pad_token_id=0,
    attention_bias=True,
    initializer_range=0.02,
)


def _llama(meta: bool = True, **overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**CFG, **overrides})
    if not meta:
        return AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _bfs(model: nn.Module, fn) -> None:
    """Visits modules breadth-first, as FSDP1 calls param_init_fn."""
    queue = [model]
    while queue:
        module = queue.pop(0)
        fn(module)
        queue.extend(module.children())


def test_values_follow_hf_init_and_rope_is_recomputed():
    model = _llama()
    initer = DelayedParamIniter(model, seed=3, device="cpu")
    with initer.validate_params_and_buffers_inited():
        _bfs(model, initer.get_param_init_fn())
    eager = _llama(meta=False)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert p.abs().sum() == 0, name
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(p.std().item() - 0.02) < 0.002, name
    assert model.model.embed_tokens.weight[0].abs().sum() == 0  # padding row
    for name, b in model.named_buffers():
        assert torch.equal(b, dict(eager.named_buffers())[name]), name


def test_visit_order_and_path_do_not_change_values():
    a, b, c = _llama(), _llama(), _llama()
    DelayedParamIniter(a, seed=5, device="cpu").init_model()
    init_b = DelayedParamIniter(b, seed=5, device="cpu").get_param_init_fn()
    _bfs(b, init_b)
    init_c = DelayedParamIniter(c, seed=5, device="cpu").get_param_init_fn()
    for module in reversed(list(c.modules())):
        init_c(module)
        init_c(module)  # a second call is a no-op
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pc), n
    d = _llama()
    DelayedParamIniter(d, seed=6, device="cpu").init_model()
    assert not torch.equal(d.lm_head.weight, a.lm_head.weight)


def test_tied_embeddings_stay_tied_whatever_the_visit_order():
    model = _llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    initer = DelayedParamIniter(model, seed=1, device="cpu")
    with initer.validate_params_and_buffers_inited():
        _bfs(model, initer.get_param_init_fn())  # FSDP1's order visits lm_head first
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight[0].abs().sum() == 0  # initialized as the embedding


def test_init_empty_weights_model_is_retied_by_post_init_fn():
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG, tie_word_embeddings=True))
    initer = DelayedParamIniter(model, seed=1, device="cpu")
    with initer.validate_params_and_buffers_inited():
        _bfs(model, initer.get_param_init_fn())
    initer.get_post_param_init_fn()(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    logits = model(torch.randint(0, 128, (1, 8))).logits
    assert torch.isfinite(logits).all()


def test_uninitializable_tensor_raises_with_its_name():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scaled())
    initer = DelayedParamIniter(model, device="cpu")
    with pytest.raises(
        RuntimeError, match=r"module '1' \(Scaled\).*parameter scale.*init_method_using_config"
    ):
        initer.init_model()


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.register_buffer("causal", torch.tril(torch.ones(4, 4, dtype=torch.bool)), False)


def test_an_integer_or_bool_buffer_no_init_writes_raises_with_its_name():
    """No NaN marks an unwritten bool or integer buffer: a causal mask built on the meta
    device would come out all False if nothing wrote it."""
    with torch.device("meta"):
        model = _Masked()
    with pytest.raises(RuntimeError, match=r"left \['buffer causal'\] uninitialized"):
        DelayedParamIniter(model, device="cpu").init_model()

    def remake_mask(module: nn.Module) -> None:
        if isinstance(module, _Masked):
            module.causal.copy_(torch.tril(torch.ones(4, 4, dtype=torch.bool)))
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    with torch.device("meta"):
        model = _Masked()
    DelayedParamIniter(model, init_method_using_config=remake_mask, device="cpu").init_model()
    assert torch.equal(model.causal, torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_validation_and_custom_init():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    initer = DelayedParamIniter(model, device="cpu")
    with (
        pytest.raises(AssertionError, match="meta device"),
        initer.validate_params_and_buffers_inited(),
    ):
        initer.get_param_init_fn()(model[0])
    seen = []

    def custom(module):
        seen.append(module)
        empty_module_params(module, "cpu")
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    initer = DelayedParamIniter(model, init_method_using_config=custom, device="cpu")
    with initer.validate_params_and_buffers_inited():
        _bfs(model, initer.get_param_init_fn())
    assert len(seen) == 3 and all(torch.all(p == 0.5) for p in model.parameters())
    assert initer.count_num_params(model[0]) == 16


def test_module_utils_materialize_non_recursively_and_keep_ties():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    empty_module_params(model, "cpu")
    assert all(p.is_meta for p in model.parameters())  # not recursive by default
    empty_module_params(model, "cpu", recurse=True)
    assert not any(p.is_meta for p in model.parameters())
    move_buffers_to_device(model[1], "cpu")
    assert not any(b.is_meta for b in model[1].buffers())
    with torch.device("meta"):
        a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    empty_module_params(nn.ModuleList([a, b]), "cpu", recurse=True)
    assert a.weight is b.weight and not a.weight.is_meta


def test_to_empty_keeping_ties_keeps_shared_tensors_shared():
    """``nn.Module.to_empty`` makes a tied pair two parameters; the rank-0 broadcast then
    expected one tensor more on the receiving ranks than rank 0 sent."""
    with torch.device("meta"):
        a, b = nn.Linear(2, 3), nn.Linear(2, 3)
        a.register_buffer("scale", torch.ones(3))
    b.weight = a.weight
    b.register_buffer("scale", a.scale)
    model = nn.ModuleList([a, b])
    to_empty_keeping_ties(model, "cpu")
    assert a.weight is b.weight and a.scale is b.scale
    assert a.bias is not b.bias
    assert len(list(model.parameters())) == 3 and not any(t.is_meta for t in model.parameters())
    assert not a.scale.is_meta


def test_get_global_ranks_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        get_global_ranks()
