"""SMP's transformer class names (``torch.sagemaker.tensor_parallel.transformer``).

In SMP, ``tsm.transform`` swaps a Hugging Face model for SMP's own ``TransformerLMHead``
built from ``TransformerLayer`` blocks, and the example scripts use those classes as the
FSDP wrap unit (``transformer_auto_wrap_policy(transformer_layer_cls={TransformerLayer})``)
and the activation-checkpointing target (``isinstance(m, TransformerLayer)``).

Our ``tsm.transform`` keeps the Hugging Face classes (``LlamaDecoderLayer`` ...), so that
module names, ``state_dict`` keys and ``from_pretrained`` keep working. These names are
therefore *roles*, not implementations: ``tsm.transform`` marks each transformer layer of the
model it transforms (the policy's ``layer_class``) and the model itself, and ``isinstance``
answers by that mark. So ``isinstance(layer, TransformerLayer)`` is true exactly for the
layers of a transformed model (and stays true for ``LlamaDecoderLayer`` too), whatever the
family, and wrapping or checkpointing by ``TransformerLayer`` picks the same modules as the
policy's layer class. The classes cannot be instantiated.
"""

from __future__ import annotations

from typing import Any

from torch import nn

#: Attribute ``tsm.transform`` sets on the modules it marks; its value is a role below.
ROLE_ATTR = "_tsm_role"
LAYER_ROLE = "transformer_layer"
MODEL_ROLE = "lm_head_model"


class _RoleMeta(type):
    """``isinstance(obj, cls)`` is true when ``obj`` carries ``cls``'s role mark."""

    _role: str
    _doc_role: str

    def __instancecheck__(cls, obj: Any) -> bool:
        # The object's own attribute only: FSDP1 units and checkpoint/offload wrappers
        # forward attribute lookups to the module they wrap, and must not pass for it.
        return getattr(obj, "__dict__", {}).get(ROLE_ATTR) == cls._role

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"torch.sagemaker.tensor_parallel.transformer.{cls.__name__} names a role, not a "
            "module to build: create the Hugging Face model (AutoModelForCausalLM.from_config / "
            f"from_pretrained) and call tsm.transform(model); its {cls._doc_role} then count as "
            f"{cls.__name__} for isinstance, auto-wrap policies and activation checkpointing."
        )


class TransformerLayer(metaclass=_RoleMeta):
    """A transformer layer of a model transformed by ``tsm.transform`` (wrap/checkpoint unit)."""

    _role = LAYER_ROLE
    _doc_role = "transformer layers"


class TETransformerLayer(metaclass=_RoleMeta):
    """SMP's name for the layer class on torch < 2.2; the same role as ``TransformerLayer``."""

    _role = LAYER_ROLE
    _doc_role = "transformer layers"


class TransformerLMHead(metaclass=_RoleMeta):
    """A causal language model transformed by ``tsm.transform`` (the model itself)."""

    _role = MODEL_ROLE
    _doc_role = "models"


def mark(model: nn.Module, layer_cls: type[nn.Module]) -> int:
    """Marks ``model`` and its ``layer_cls`` modules with their roles (called by ``tsm.transform``).

    Args:
        model: The transformed model.
        layer_cls: The policy's transformer layer class.

    Returns:
        The number of layers marked.
    """
    setattr(model, ROLE_ATTR, MODEL_ROLE)
    layers = [m for m in model.modules() if type(m) is layer_cls]
    for layer in layers:
        setattr(layer, ROLE_ATTR, LAYER_ROLE)
    return len(layers)


__all__ = ["TETransformerLayer", "TransformerLMHead", "TransformerLayer", "mark"]
