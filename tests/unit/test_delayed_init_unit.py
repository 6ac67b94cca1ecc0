"""DelayedParamIniter and module_utils in one process (no FSDP): values, order, ties, errors."""

from __future__ import annotations

from types import SimpleNamespace

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


def _gpt2(n_layer: int, meta: bool = True):
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(
        vocab_size=128, n_embd=128, n_layer=n_layer, n_head=4, n_positions=64, bos_token_id=0
    )
    config.eos_token_id = 0
    if not meta:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("n_layer", [2, 12])
def test_gpt2_scaled_residual_init_set_by_the_parent_module(n_layer):
    """GPT-2's ``_init_weights`` on ``GPT2Attention`` / ``GPT2MLP`` draws their child
    ``c_proj.weight`` again with std 0.02 / sqrt(2 * n_layer); delayed init kept the child's
    own draw (std 0.02: 0.0201 against 0.00998 for 2 layers, 0.00407 for 12)."""
    eager = _gpt2(n_layer, meta=False)
    by_path = {}
    model = _gpt2(n_layer)
    DelayedParamIniter(model, seed=1, device="cpu").init_model()
    by_path["init_model"] = model
    model = _gpt2(n_layer)
    initer = DelayedParamIniter(model, seed=1, device="cpu")
    with initer.validate_params_and_buffers_inited():
        _bfs(model, initer.get_param_init_fn())  # FSDP1 visits the parent before c_proj
    by_path["param_init_fn"] = model
    model = _gpt2(n_layer)
    init_fn = DelayedParamIniter(model, seed=1, device="cpu").get_param_init_fn()
    for module in reversed(list(model.modules())):  # c_proj before its parent
        init_fn(module)
    by_path["reversed"] = model
    scaled = 0.02 / (2 * n_layer) ** 0.5
    want = dict(eager.named_parameters())
    for path, model in by_path.items():
        got = dict(model.named_parameters())
        for layer in (0, n_layer - 1):
            for name, std in (
                (f"transformer.h.{layer}.attn.c_proj.weight", scaled),
                (f"transformer.h.{layer}.mlp.c_proj.weight", scaled),
                (f"transformer.h.{layer}.attn.c_attn.weight", 0.02),  # no parent rule
                (f"transformer.h.{layer}.mlp.c_fc.weight", 0.02),
            ):
                hf = want[name].std().item()
                assert abs(hf - std) < 0.05 * std, (name, hf)  # the rule as HF applies it
                assert abs(got[name].std().item() - hf) < 0.05 * std, (path, name, hf)
                assert abs(got[name].mean().item()) < 0.05 * std, (path, name)
        for name, p in got.items():  # the rest as before: biases zero, norms one
            if name.endswith("bias") or name.endswith("ln_1.weight"):
                assert torch.equal(p, want[name]), (path, name)
    for name, p in by_path["init_model"].named_parameters():  # layout-independent values
        assert torch.equal(p, dict(by_path["param_init_fn"].named_parameters())[name]), name
        assert torch.equal(p, dict(by_path["reversed"].named_parameters())[name]), name


class _Outer(nn.Module):
    """A model whose init calls on parents write their descendants' tensors, in every way
    Hugging Face models do: a torch init function, ``.data``, one that skips meta tensors
    (``trunc_normal_``), an indexed write, a buffer, and a grandparent's rule."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(initializer_range=0.02)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.block[1].register_buffer("scale", torch.ones(3))
        self.head = nn.Linear(16, 4)

    def _init_weights(self, module: nn.Module) -> None:  # children before parents
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=1.0)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Sequential):
            module[0].weight.data.mul_(0.0).add_(2.0)
            nn.init.trunc_normal_(module[0].bias, mean=5.5, std=0.2, a=5.0, b=6.0)
            module[1].weight[0].fill_(-1.0)
            module[1].scale.fill_(4.0)
        elif module is self:
            nn.init.constant_(self.block[1].bias, 7.0)
            self.head.weight.data.fill_(8.0)


def _hf_walk(model: nn.Module) -> None:
    """Hugging Face's order: every module's call, children first (``initialize_weights``)."""

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        model._init_weights(module)

    with torch.no_grad():
        visit(model)


def test_any_rule_a_parent_applies_to_descendants_is_kept():
    eager = _Outer()
    _hf_walk(eager)
    models = []
    for path in ("init_model", "param_init_fn"):
        with torch.device("meta"):
            model = _Outer()
        initer = DelayedParamIniter(model, seed=2, device="cpu")
        with initer.validate_params_and_buffers_inited():
            if path == "init_model":
                initer.init_model()
            else:
                _bfs(model, initer.get_param_init_fn())
        models.append(model)
        block = model.block
        assert torch.equal(block[0].weight, eager.block[0].weight), path  # all 2.0
        assert ((block[0].bias >= 5.0) & (block[0].bias <= 6.0)).all(), path
        assert torch.equal(block[1].weight[0], eager.block[1].weight[0]), path  # -1.0
        assert 0.5 < block[1].weight[1:].std().item() < 1.5, path  # its own draw elsewhere
        assert torch.equal(block[1].scale, eager.block[1].scale), path
        assert torch.equal(block[1].bias, eager.block[1].bias), path  # the grandparent's 7.0
        assert torch.equal(model.head.weight, eager.head.weight), path  # the root's 8.0
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


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
