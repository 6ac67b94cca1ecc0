"""The model the planner plans for: a Hugging Face ``config.json`` read locally, never downloaded.

``load_model`` reads the file, builds the causal LM on the meta device (shapes only, no
memory), finds its policy the way ``tsm.transform`` does, and records every parameter with
what decides where it goes: the FSDP unit that owns it (a transformer layer, a layer's
experts, or the root), the tensor parallel style of its module in the policy's plan, and
whether it is an expert weight. The memory model shards these shapes; the time model reads
the dimensions.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from torch_sagemaker.planner.config_file import read_config
from torch_sagemaker.policies import ModelPolicy, lookup_policy
from torch_sagemaker.policies.model_policy import config_value
from torch_sagemaker.utils.hf_config import text_config

ROOT = "root"


@dataclass(frozen=True)
class Param:
    """One parameter of the model, as the memory model needs it.

    Attributes:
        name: Its Hugging Face name.
        shape: Its full (unsharded) shape.
        unit: The FSDP unit that owns it: ``"layers.<i>"``, ``"experts.<i>"`` (the experts of
            layer ``i``, a unit of their own when split over the EP ranks) or ``"root"``.
        style: The tensor parallel style of its module in the policy's plan, or ``None``.
        expert: Whether it is a fused expert weight (split over the EP ranks).
        router: Whether it belongs to an MoE block's router (an fp32 unit of its own under
            mixed precision with an MoEConfig).
        tied_to: For a second name of a tied parameter (a head tied to the embedding), the
            first name; the model holds it once.
    """

    name: str
    shape: tuple[int, ...]
    unit: str
    style: str | None
    expert: bool
    router: bool = False
    tied_to: str | None = None

    @property
    def leaf(self) -> str:
        """The attribute name on its module (``"weight"``, ``"bias"``, ``"gate_up_proj"``)."""
        return self.name.rpartition(".")[2]

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        n = 1
        for d in self.shape:
            n *= d
        return n


#: Multi-head latent attention's config attributes (DeepSeek V2/V3 and the families built on
#: them), in ``LatentAttention``'s field order.
LATENT_ATTRS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class LatentAttention:
    """The sizes of multi-head latent attention (MLA).

    Queries are projected to ``q_lora`` (or directly, when ``None``), keys and values to one
    shared latent of ``kv_lora`` plus a key part of ``rope`` that rotary rotates and every head
    shares; each head then expands the latent to its key part of ``nope`` and its value of
    ``v_head``. A query/key head is ``nope + rope`` wide.
    """

    q_lora: int | None
    kv_lora: int
    rope: int
    nope: int
    v_head: int

    def size_values(self, heads: int) -> dict[str, int]:
        """The size names of its widths in saved activations (``Saved.size``), for ``heads``.

        The ranks and the rotary part every head shares are whole under tensor parallelism;
        ``heads_nope`` and ``heads_v`` are per head (pass a rank's heads for its part).
        """
        values = {
            "kv_lora": self.kv_lora,
            "rope": self.rope,
            "heads_nope": heads * self.nope,
            "heads_v": heads * self.v_head,
        }
        if self.q_lora:
            values["q_lora"] = self.q_lora
        return values


def latent_attention(config: Any) -> LatentAttention | None:
    """``config``'s multi-head latent attention sizes, or ``None`` where it has none."""
    q_lora, *sizes = (getattr(config, attr, None) for attr in LATENT_ATTRS)
    ints = [v for v in sizes if isinstance(v, int) and not isinstance(v, bool)]
    if len(ints) != len(sizes):
        return None
    kv_lora, rope, nope, v_head = ints
    q_rank = q_lora if isinstance(q_lora, int) and q_lora > 0 else None
    return LatentAttention(q_rank, kv_lora, rope, nope, v_head)


@dataclass(frozen=True)
class ModelSpec:
    """A model's parameters and the dimensions the planner's models read.

    Attributes:
        name: The model class (``"LlamaForCausalLM"``).
        source: Where the config was read.
        policy: Its policy, as ``tsm.transform`` looks it up.
        config: The Hugging Face config object.
        params: Every parameter name in ``named_parameters(remove_duplicate=False)`` order;
            a tied parameter's later names have ``tied_to`` set.
        layer_units: The names of the transformer-layer units, in order.
        embedding: The name of the input embedding's weight (a lookup, no FLOPs).
    """

    name: str
    source: str
    policy: ModelPolicy
    config: Any
    params: tuple[Param, ...]
    layer_units: tuple[str, ...]
    embedding: str = ""

    @property
    def num_layers(self) -> int:
        """Transformer layers."""
        return len(self.layer_units)

    @property
    def num_params(self) -> int:
        """Parameters of the whole model (a tied parameter once)."""
        return sum(p.numel for p in self.params if p.tied_to is None)

    def dim(self, attr: str, default: int | None = None) -> int:
        """An integer attribute of the config (``hidden_size``, ...).

        Raises:
            ValueError: If the config has no such attribute and no default was given.
        """
        value = config_value(self.config, attr)
        if value is None:
            if default is None:
                raise ValueError(f"{self.name} config ({self.source}) has no {attr}.")
            return default
        return int(value)

    @property
    def mlp_size(self) -> int:
        """A dense MLP's intermediate size (0 where the config names none).

        ``intermediate_size``, or the name the family's config uses instead
        (``MLP_SIZE_ATTRS``: BART-like decoders' ``decoder_ffn_dim``, OPT's ``ffn_dim``).
        """
        attr = mlp_size_attr(self.config)
        return self.dim(attr, 0) if attr else 0

    @property
    def heads(self) -> tuple[int, int]:
        """(query heads, key/value heads)."""
        return self.policy.head_counts(self.config)

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        explicit = getattr(self.config, "head_dim", None)
        return int(explicit) if explicit else self.dim("hidden_size") // self.heads[0]

    @property
    def latent(self) -> LatentAttention | None:
        """Multi-head latent attention's sizes (DeepSeek V2/V3), ``None`` for other attention."""
        return latent_attention(self.config)

    @property
    def qk_v_head_dims(self) -> tuple[int, int]:
        """(a query/key head's size, a value head's size): both ``head_dim`` but under MLA."""
        latent = self.latent
        if latent is None:
            return self.head_dim, self.head_dim
        return latent.nope + latent.rope, latent.v_head

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (0 for dense models)."""
        return self.policy.num_experts(self.config)

    @property
    def untrained(self) -> frozenset[str]:
        """Names of the parameters no output of the forward reaches: they get no gradient.

        Those the policy's ``ActivationProfile.no_gradient`` names (measured by the probe
        for families without a written profile); none where the policy has no profile.
        """
        profile = self.policy.activations
        patterns = profile.no_gradient if profile is not None else ()
        return frozenset(
            p.name for p in self.params if any(fnmatchcase(p.name, pat) for pat in patterns)
        )


#: Config attributes holding a dense MLP's intermediate size, in the order they are read.
MLP_SIZE_ATTRS = (
    "intermediate_size_mlp",  # Llama 4's dense layers (its experts': ``expert_mlp_attr``)
    "intermediate_size",
    "decoder_ffn_dim",
    "ffn_dim",
    "n_inner",
    "ffn_hidden_size",  # Falcon
    "dff",  # CTRL
    "ffn_config.ffn_hidden_size",  # DBRX's nested MoE config (its experts are its MLPs)
)


def mlp_size_attr(config: Any) -> str | None:
    """The first of ``MLP_SIZE_ATTRS`` that ``config``'s class defines and ``config`` sets.

    A name the class does not define is a stray key the model never reads (a config
    written with ``intermediate_size`` for OPT, whose MLP is ``ffn_dim``).
    """
    known = _class_attrs(type(config))
    return next(
        (a for a in MLP_SIZE_ATTRS if a in known and config_value(config, a) is not None), None
    )


def expert_mlp_attr(config: Any) -> str | None:
    """The config attribute with one routed expert's intermediate size, where it has its own.

    ``moe_intermediate_size`` (Qwen2-MoE, DeepSeek, ...), or ``intermediate_size`` where the
    dense MLP's size is another attribute (Llama 4's ``intermediate_size_mlp``); ``None``
    where the experts are as wide as the dense MLP.
    """
    if getattr(config, "moe_intermediate_size", None) is not None:
        return "moe_intermediate_size"
    if mlp_size_attr(config) == "intermediate_size_mlp":
        return "intermediate_size"
    return None


_CLASS_ATTRS: dict[type, frozenset[str]] = {}


def _defines(config: Any, path: str) -> bool:
    """Whether ``config`` has the attribute ``path`` names (dotted: in a nested config)."""
    outer, _, last = path.rpartition(".")
    owner = config_value(config, outer) if outer else config
    return owner is not None and hasattr(owner, last)


def _class_attrs(cls: type) -> frozenset[str]:
    """Which of ``MLP_SIZE_ATTRS`` a config class defines (on its default instance)."""
    if cls not in _CLASS_ATTRS:
        try:
            default = cls()
        except Exception:  # noqa: BLE001 - a class without defaults: trust the instance
            _CLASS_ATTRS[cls] = frozenset(MLP_SIZE_ATTRS)
        else:
            _CLASS_ATTRS[cls] = frozenset(a for a in MLP_SIZE_ATTRS if _defines(default, a))
    return _CLASS_ATTRS[cls]


def model_class(config: Any) -> type[nn.Module]:
    """The causal LM class transformers builds from ``config`` (its ``architectures`` first).

    Else the class transformers maps its ``model_type`` to, or else a causal LM class built
    from its config class (a multimodal family's text model: ``MllamaForCausalLM``).

    Raises:
        ValueError: If transformers has no causal LM class for its ``model_type``.
    """
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None and name.endswith("ForCausalLM"):
            return cls
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None:  # a sub-config's causal LM (Mllama's text model): by its config class
        name = next(
            (
                n
                for n in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
                if getattr(getattr(transformers, n, None), "config_class", None) is type(config)
            ),
            None,
        )
    if name is None:
        raise ValueError(
            f"model_type {config.model_type!r} has no causal LM class in transformers; the "
            "planner plans causal LMs that tsm.transform supports."
        )
    return getattr(transformers, name)


def _config_for(cls: type[nn.Module], config: Any) -> Any:
    """The config ``cls`` is built from: ``config``, or its text config where ``cls`` takes that.

    A composite checkpoint's causal LM is built from its text config, as
    ``AutoModelForCausalLM.from_config`` builds Qwen 3.5's or Llama 4's from the image-text one.
    """
    wanted = getattr(cls, "config_class", None)
    if not isinstance(wanted, type) or isinstance(config, wanted):
        return config
    getter = getattr(config, "get_text_config", None)
    try:
        text = getter(decoder=True) if callable(getter) else None
    except ValueError:  # several text configs: transformers refuses to choose, and so do we
        return config
    return text if isinstance(text, wanted) else config


def _style(policy: ModelPolicy, module: str) -> str | None:
    return next((s for p, s in policy.tp_plan.items() if fnmatchcase(module, p)), None)


def describe(model: nn.Module, policy: ModelPolicy, source: str = "") -> ModelSpec:
    """The ``ModelSpec`` of a built model (real or meta).

    Args:
        model: A Hugging Face causal LM covered by ``policy``.
        policy: Its policy.
        source: Where it came from, for messages.
    """
    layers = [n for n, m in model.named_modules() if type(m).__name__ == policy.layer_class]
    blocks = []
    if policy.moe is not None:
        blocks = [n for n, m in model.named_modules() if type(m).__name__ == policy.moe.block_class]
    experts = {f"{n}.{policy.moe.experts}" for n in blocks} if policy.moe else set()
    routers = {f"{n}.{policy.moe.router}" for n in blocks} if policy.moe else set()
    params = []
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied_to = first.setdefault(id(param), name)
        module = name.rpartition(".")[0]
        layer = next((i for i, n in enumerate(layers) if module.startswith(n + ".")), None)
        expert = module in experts
        unit = ROOT if layer is None else f"{'experts' if expert else 'layers'}.{layer}"
        params.append(
            Param(
                name,
                tuple(param.shape),
                unit,
                _style(policy, module),
                expert,
                router=module in routers,
                tied_to=tied_to if tied_to != name else None,
            )
        )
    params = _tied_follow_the_split(params)
    get_embeddings = getattr(model, "get_input_embeddings", None)
    weight = getattr(get_embeddings(), "weight", None) if callable(get_embeddings) else None
    embedding = next((n for n, p in model.named_parameters() if p is weight), "")
    return ModelSpec(
        name=type(model).__name__,
        source=source,
        policy=policy,
        config=text_config(model),
        params=tuple(params),
        layer_units=tuple(f"layers.{i}" for i in range(len(layers))),
        embedding=embedding,
    )


def _tied_follow_the_split(params: list[Param]) -> list[Param]:
    """``params`` with a tied parameter split as the name of it that a split style names.

    The memory model cuts a tied parameter under its first name; ``tsm.transform`` splits it
    where any of its names is split (Note [Tied parameters of parameter holders] in
    ``torch_sagemaker/tensor_parallel/plan.py``): BERT's ``cls.predictions.bias``, tied to
    the vocabulary-split ``cls.predictions.decoder.bias``.
    """
    from torch_sagemaker.tensor_parallel.styles import param_split_dim

    def splits(p: Param) -> bool:
        return p.style is not None and param_split_dim(p.style, p.leaf) is not None

    index = {p.name: i for i, p in enumerate(params)}
    params = list(params)
    for p in params:
        first = params[index[p.tied_to]] if p.tied_to is not None else None
        if first is not None and splits(p) and not splits(first) and p.leaf == first.leaf:
            params[index[first.name]] = dataclasses.replace(first, style=p.style)
    return params


def load_model(path: str | os.PathLike[str]) -> ModelSpec:
    """Reads ``path`` and describes the model (built on the meta device, nothing allocated).

    Raises:
        ValueError: For an unreadable or inconsistent config (one the model cannot be built
            from), or a model no policy covers (as ``tsm.transform`` would refuse it).
    """
    config = read_config(path)
    cls = model_class(config)
    try:
        with torch.device("meta"):
            model = cls(_config_for(cls, config))
    except (RuntimeError, ValueError, TypeError, ArithmeticError, AssertionError) as e:
        # Sizes that pass transformers' and _check_sizes's checks but not the layers' own
        # arithmetic (an inconsistent rope setting, a split that does not divide).
        raise ValueError(
            f"model config {os.fspath(path)!r}: {cls.__name__} cannot be built from it "
            f"({type(e).__name__}: {e}). Fix the config's sizes."
        ) from None
    return describe(model, lookup_policy(model), os.fspath(path))


__all__ = [
    "MLP_SIZE_ATTRS",
    "ROOT",
    "ModelSpec",
    "Param",
    "describe",
    "load_model",
    "mlp_size_attr",
    "expert_mlp_attr",
    "model_class",
]
