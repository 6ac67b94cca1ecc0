"""Policy matching, coverage of every parameter, head bookkeeping and registration (no
processes)."""

from __future__ import annotations

from fnmatch import fnmatchcase

import pytest
import torch

from torch_sagemaker import policies
from torch_sagemaker.policies import (
    STYLES,
    ModelPolicy,
    check_model,
    get_policy,
    lookup_policy,
    split_heads,
    transformer_layer_classes,
)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaDecoderLayer"),
    "mistral": ("MistralConfig", "MistralDecoderLayer"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXLayer"),
    "mixtral": ("MixtralConfig", "MixtralDecoderLayer"),
    "qwen2": ("Qwen2Config", "Qwen2DecoderLayer"),
}


def meta_model(family: str, **kwargs):
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = getattr(transformers, FAMILIES[family][0])(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        **kwargs,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request):
    return request.param, meta_model(request.param)


def test_lookup_finds_the_family_policy_and_layer_class(family_model):
    family, model = family_model
    policy = lookup_policy(model)
    assert policy.name == family
    assert [c.__name__ for c in transformer_layer_classes(model)] == [FAMILIES[family][1]]
    assert get_policy(model) is None  # nothing recorded before tsm.transform


def test_plan_patterns_match_and_cover_every_parameter(family_model):
    """Each pattern matches a module, and every parameter's module is parallelized by some
    pattern."""
    _, model = family_model
    policy = lookup_policy(model)
    names = [n for n, _ in model.named_modules() if n]
    for pattern in policy.tp_plan:
        assert any(fnmatchcase(n, pattern) for n in names), pattern
    for pname, _ in model.named_parameters():
        owner = pname.rsplit(".", 1)[0]
        assert any(fnmatchcase(owner, p) for p in policy.tp_plan), pname
    assert policy.attention_modules(model), "no attention modules found"


def test_subclasses_match():
    from transformers import LlamaForCausalLM

    class MyLlama(LlamaForCausalLM):
        pass

    model = meta_model("llama")
    model.__class__ = MyLlama
    assert lookup_policy(model).name == "llama"


def test_unsupported_model_error_lists_classes_and_registration():
    with pytest.raises(ValueError) as err:
        lookup_policy(torch.nn.Linear(2, 2))
    message = str(err.value)
    for cls in (
        "GPTNeoXForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "Qwen2ForCausalLM",
    ):
        assert cls in message
    assert "register_policy" in message


def test_register_policy_wins_and_unregisters():
    mine = ModelPolicy(
        name="mine",
        model_classes=("Linear",),
        layer_class="Linear",
        attention="x",
        tp_plan={"x": "colwise"},
    )
    policies.register_policy(mine)
    try:
        assert lookup_policy(torch.nn.Linear(2, 2)) is mine
        assert policies.registered_policies()[0] is mine
    finally:
        policies.unregister_policy(mine)
    with pytest.raises(ValueError):
        lookup_policy(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError):
        policies.register_policy({"name": "not a policy"})


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)


class _Other(torch.nn.Module):
    pass


class _Unregistered(torch.nn.Module):
    """A model no policy covers, with Hugging Face's ``_no_split_modules``."""

    _no_split_modules = ["_Block", "_Other", "NotInTheModel"]

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Other(), _Block()])


def test_transformer_layer_classes_one_rule_for_every_model():
    """A policy's model: its layer class, and nothing else even with _no_split_modules; any
    other model: the _no_split_modules classes it contains, in order; else an error naming
    the fix. The same function is the sharding package's name."""
    from torch_sagemaker import sharding

    assert sharding.transformer_layer_classes is transformer_layer_classes
    llama = meta_model("llama")
    assert llama._no_split_modules  # Hugging Face lists it too; the policy decides
    assert [c.__name__ for c in transformer_layer_classes(llama)] == ["LlamaDecoderLayer"]
    assert transformer_layer_classes(_Unregistered()) == (_Block, _Other)
    for bare in (torch.nn.Linear(2, 2), torch.nn.Sequential(_Block())):
        with pytest.raises(ValueError, match="no transformer layer class.*register_policy"):
            transformer_layer_classes(bare)


def test_transformer_layer_classes_refuses_a_policy_that_does_not_fit():
    """A covering policy whose layer class the model lacks is an error, not a fallback to
    _no_split_modules (that would shard another unit than the policy says)."""
    mine = ModelPolicy(
        name="mine",
        model_classes=("_Unregistered",),
        layer_class="MissingLayer",
        attention="x",
        tp_plan={"x": "colwise"},
    )
    policies.register_policy(mine)
    try:
        with pytest.raises(ValueError, match="has no MissingLayer module"):
            transformer_layer_classes(_Unregistered())
    finally:
        policies.unregister_policy(mine)


def test_transformer_layer_classes_reads_the_recorded_policy_through_wrappers():
    """The policy ``tsm.transform`` recorded wins over the registry, also inside a wrapper."""
    from torch_sagemaker._torch_compat.checkpoint_wrapper import checkpoint_wrapper

    model = _Unregistered()
    mine = ModelPolicy(
        name="mine",
        model_classes=("NotThisClass",),
        layer_class="_Other",
        attention="x",
        tp_plan={"x": "colwise"},
    )
    setattr(model, policies.POLICY_ATTR, mine)
    assert transformer_layer_classes(checkpoint_wrapper(model)) == (_Other,)


def test_unknown_style_is_rejected():
    with pytest.raises(ValueError, match="unknown TP styles"):
        ModelPolicy(
            name="bad",
            model_classes=("X",),
            layer_class="X",
            attention="a",
            tp_plan={"a.b": "diagonal"},
        )
    assert "colwise" in STYLES and "experts" in STYLES


@pytest.mark.parametrize(
    "heads, kv, tp, local, local_kv, replicated, kv_heads_by_rank",
    [
        (4, 4, 2, 2, 2, False, [0, 2]),
        (8, 4, 2, 4, 2, False, [0, 2]),
        (4, 2, 2, 2, 1, False, [0, 1]),
        (4, 1, 2, 2, 1, True, [0, 0]),
        (4, 2, 4, 1, 1, True, [0, 0, 1, 1]),
        (32, 8, 16, 2, 1, True, [r // 2 for r in range(16)]),
    ],
)
def test_split_heads(heads, kv, tp, local, local_kv, replicated, kv_heads_by_rank):
    split = split_heads(heads, kv, tp)
    assert (split.local_heads, split.local_kv_heads, split.kv_replicated) == (
        local,
        local_kv,
        replicated,
    )
    assert [split.kv_head_of(r) for r in range(tp)] == kv_heads_by_rank
    # Every query head of a rank attends with a kv head that the rank holds.
    group = heads // kv
    for r in range(tp):
        held = range(split.kv_head_of(r), split.kv_head_of(r) + split.local_kv_heads)
        for q in range(r * split.local_heads, (r + 1) * split.local_heads):
            assert q // group in held, (r, q)


@pytest.mark.parametrize(
    "heads, kv, tp, fragment",
    [
        (3, 3, 2, "does not divide num_attention_heads=3"),
        (12, 3, 2, "num_key_value_heads=3"),
        (12, 4, 8, "does not divide num_attention_heads=12"),
        (6, 4, 2, "is not a multiple of"),
    ],
)
def test_split_heads_errors(heads, kv, tp, fragment):
    with pytest.raises(ValueError, match=fragment):
        split_heads(heads, kv, tp)


def test_experts_must_divide():
    model = meta_model("mixtral", num_local_experts=3, num_key_value_heads=2)
    with pytest.raises(ValueError, match="does not divide the number of experts"):
        check_model(lookup_policy(model), model.config, 2)
    assert check_model(lookup_policy(model), model.config, 1).local_heads == 4


def test_gpt_neox_is_multi_head():
    model = meta_model("gpt_neox")
    assert lookup_policy(model).head_counts(model.config) == (4, 4)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt_neox"])
def test_intermediate_size_must_divide(family):
    """Found before any DTensor exists (it used to fail inside DTensor at the first forward)."""
    kwargs = {} if family == "gpt_neox" else {"num_key_value_heads": 2}
    model = meta_model(family, **kwargs)
    model.config.intermediate_size = 129
    with pytest.raises(
        ValueError,
        match=rf"{family}: tensor_parallel_degree=2 does not divide "
        r"intermediate_size=129; the MLP's columns .* are split "
        r"evenly .* Use a degree that divides 129 \(\[1, 3, 43\]\)",
    ):
        check_model(lookup_policy(model), model.config, 2)
    assert check_model(lookup_policy(model), model.config, 1).local_heads == 4
    model.config.intermediate_size = 130
    assert check_model(lookup_policy(model), model.config, 2).local_heads == 2


def test_the_planner_knows_how_every_style_splits_its_parameters():
    """The planner sizes each rank's shards from ``PARAM_SPLIT_DIMS``: a style missing there
    made planning a model that uses it fail (the fused projections computed by rows)."""
    from torch_sagemaker.tensor_parallel.styles import PARAM_SPLIT_DIMS

    assert set(policies.STYLES) <= set(PARAM_SPLIT_DIMS), set(policies.STYLES) - set(
        PARAM_SPLIT_DIMS
    )
