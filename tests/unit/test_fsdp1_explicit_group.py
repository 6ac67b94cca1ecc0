"""An explicit ``process_group``/``device_mesh`` opts an FSDP1 instance out of the SMP config,
except for a model whose parts need the plan's own meshes: split experts or context
parallelism. There it is refused, naming why, instead of training wrongly."""

from types import SimpleNamespace

import pytest
from torch import nn

from torch_sagemaker.sharding import experts, fsdp1


@pytest.mark.parametrize(
    ("cp_size", "split", "words"),
    [(2, False, "context_parallel_degree=2"), (1, True, "experts are split")],
)
@pytest.mark.parametrize("argument", ["process_group", "device_mesh"])
def test_explicit_group_is_refused_for_split_models(monkeypatch, cp_size, split, words, argument):
    monkeypatch.setattr(fsdp1, "state", SimpleNamespace(initialized=True, cp_size=cp_size))
    monkeypatch.setattr(experts, "expert_modules", lambda m: [m] if split else [])
    with pytest.raises(ValueError, match=words) as raised:
        fsdp1._patched_init(object(), nn.Linear(2, 2), **{argument: object()})
    assert "torch_sagemaker.sharding.exempt(model)" in str(raised.value)


def test_explicit_group_is_left_alone_for_other_models(monkeypatch):
    monkeypatch.setattr(fsdp1, "state", SimpleNamespace(initialized=True, cp_size=1))
    monkeypatch.setattr(experts, "expert_modules", lambda m: [])
    seen = {}

    def original(self, module, process_group, sharding_strategy, *args, **kwargs):
        seen["group"] = process_group

    monkeypatch.setattr(fsdp1, "_original_init", original)
    monkeypatch.setattr(fsdp1.fsdp1_layout, "adapt", lambda self: None)
    group = object()
    fsdp1._patched_init(object(), nn.Linear(2, 2), process_group=group)
    assert seen["group"] is group
