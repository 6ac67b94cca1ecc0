"""A policy built from a model's own transformers TP plan, for families no policy covers.

transformers ships, on most decoder configs, ``base_model_tp_plan``: module-name patterns
(``layers.*.self_attn.q_proj``) mapped to its style names (``colwise``, ``rowwise``,
``colwise_gather_output``, ...). A model instance merges it with its class's own entries
(``lm_head``) and the input embedding into ``model.tp_plan``. ``policy_from_plan`` turns
that plan into an ordinary ``ModelPolicy``, so ``tsm.transform`` applies it like any other
policy (``registry.lookup_policy`` is the one place the two meet; a policy for the class
always wins).

Note [Plan-driven layout]: transformers' styles assume that activations between the split
regions are whole on every rank (a rowwise layer all-reduces), not split over the sequence
as our policies' are. The translation keeps that layout (``tensor_parallel.replicated_styles``):
it is the one the model's own code between the planned modules was written for, so nothing
else about the model has to be known. Modules the plan leaves out hold their parameters
replicated (``replicate_local``, at the root of each planless subtree), as transformers
does: they see whole activations. A module above them whose own code reads their weights
or calls their methods (a linear-attention block that convolves with its child's weight)
gets plain values of them too (``local_params``). A module the plan leaves out *beside* a
split projection (a per-head norm) may see only this rank's part, which the plan does not
say: replicated modules check on first use that they do not (Note [Replicated module
check] in ``tensor_parallel/consistency.py``); a module whose own left-out parameters sit
above split projections is refused; every entry the translation cannot honour is an
error naming the module, the style and the fix. Nothing is replicated silently.

What is read from the model besides the plan, all generic: module types (``nn.Linear``,
``nn.Embedding``, the output embedding), the config's head counts and ``head_dim`` (key and
value projections are the attention projections of ``num_key_value_heads * head_dim``
outputs; they are replicated when there are fewer kv heads than ranks), the classes named
by ``_no_split_modules`` (the transformer layer), attention modules by their class names
(``...Attention``), and fused experts by their layout (``module_layout.expert_count``).
"""

from __future__ import annotations

import inspect
import re
from fnmatch import fnmatchcase

from torch import nn

from torch_sagemaker.policies.model_policy import (
    ModelPolicy,
    MoESpec,
    config_value,
)
from torch_sagemaker.policies.module_layout import (
    FULL_WIDTH_ATTRS,
    attention_head_dim,
    expert_count,
    packed_blocks,
    transformer_layer_class,
)
from torch_sagemaker.policies.plan_sources import (
    embeddings,
    only_the_class_head,
    own_plan,
    shipped_from_root,
    wildcard,
    with_additions,
    with_plan_experts,
    with_tied_input_embedding,
)
from torch_sagemaker.policies.shipped_plans import (
    experts_without_sentinel,
    heads_attr,
    layout_check,
    width_attrs,
)
from torch_sagemaker.utils.hf_config import text_config
from torch_sagemaker.utils.projections import is_conv1d

#: transformers' styles whose module must be an ``nn.Linear``, and ours for them.
_LINEAR_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise_allreduce",
    "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather",
    "rowwise_split_input": "rowwise_split_input",
    "rowwise_rep": "rowwise_split_input",
    # weight whole, each rank its rows of each block: Note [Fused projections computed by rows]
    "packed_colwise": "linear_packed_colwise",
    # ours, not transformers': the same note
    "shared_kv_colwise": "shared_kv_colwise",
    # transformers 5.25's whole-head styles (MiniCPM5-MoE's key and value projections): each
    # rank keeps whole heads, repeated over ranks when there are fewer heads than ranks. That
    # is what ours do: a key/value projection's colwise is kv_colwise (kv heads replicated
    # below the degree), and tsm.transform requires query heads the degree divides.
    "unit_colwise": "colwise",
    "unit_rowwise": "rowwise_allreduce",
}
#: transformers' styles on a transformers ``Conv1D`` (a Linear stored transposed), and ours.
_CONV1D_STYLES = {
    "colwise": "conv1d_colwise",
    "rowwise": "conv1d_rowwise_allreduce",
    "packed_colwise": "conv1d_packed_colwise",
}
#: transformers' styles whose module must be an ``nn.Embedding``, and ours for them.
_EMBEDDING_STYLES = {
    "embedding_rowwise": "vocab_embedding_allreduce",
    "embedding_colwise": "hidden_embedding",
}
#: transformers' styles for any module, and ours for them.
_MODULE_STYLES = {
    "replicated_with_grad_allreduce": "replicate_partial_grad",
    "replicate": "replicate_local",
    "all_reduce": "reduce_output",
    "local_params": "local_params",
    "sequence_parallel": "sequence_parallel_local",
    "mla_kv_a_proj": "mla_kv_a_proj",
    # ours, not transformers': Note [Head-indexed inputs]
    "head_inputs": "head_inputs",
}
#: transformers' styles on a bare parameter, and ours for them.
_PARAMETER_STYLES = {"colwise": "param_colwise", "rowwise": "param_rowwise"}
#: transformers' styles on the parameters of fused experts (the ``experts`` style splits them).
_EXPERT_PARAMETER_STYLES = {"packed_colwise", "packed_rowwise", "colwise", "rowwise"}
#: Our styles whose output is this rank's part of the features (heads, MLP columns).
_SPLIT_OUTPUT = {
    "colwise",
    "kv_colwise",
    "conv1d_colwise",
    "conv1d_packed_colwise",
    "shared_kv_colwise",
    "linear_packed_colwise",
}
#: Config attributes that may hold the key/value head count (Falcon's: ``num_kv_heads``).
# DBRX's attention reads its nested attn_config.kv_n_heads (num_key_value_heads is a copy).
_KV_HEADS_ATTRS = ("attn_config.kv_n_heads", "num_key_value_heads", "num_kv_heads")
#: Config attributes that may hold the expert count.
_EXPERT_COUNT_ATTRS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "ffn_config.moe_num_experts",  # DBRX's nested MoE config
)
#: Where configs keep the experts each token is routed to.
_TOP_K_ATTRS = ("num_experts_per_tok", "ffn_config.moe_top_k")

#: In the notes of a policy whose TP plan is its model's transformers plan.
PLAN_TP_NOTE = "Tensor parallel plan: the model's transformers plan."
#: In the notes of a policy whose TP plan is the one ``shipped_plans`` gives its family.
SHIPPED_PLAN_NOTE = "Tensor parallel plan: torch_sagemaker's shipped plan for its family."

_FIX = (
    "To shard {model} anyway, register a torch_sagemaker.policies.ModelPolicy for it "
    "(docs/tensor_parallel.md), or set model.tp_plan (transformers' setter) to a plan without "
    "this entry before tsm.transform; the module then stays replicated."
)


_FIX_LEFT_OUT = (
    "To shard {model} anyway, set model.tp_plan (transformers' setter) before tsm.transform "
    "to a plan that gives it an entry ('local_params' with entries splitting per-head "
    "parameters, 'replicated_with_grad_allreduce' for parameters used on this rank's heads), "
    "or register a torch_sagemaker.policies.ModelPolicy for it (docs/tensor_parallel.md)."
)


class _Translation:
    """One model's plan translated entry by entry (``policy_from_plan`` builds it)."""

    def __init__(
        self,
        model: nn.Module,
        plan: dict[str, str],
        layer_class: str,
        heads_attr: str | None,
        width_attrs: tuple[tuple[str, str | None], ...] = (),
    ) -> None:
        self.model, self.plan, self.layer_class = model, plan, layer_class
        self.width_attrs = width_attrs  # the family's own (ModelPolicy.width_attrs)
        # Keys naming a numbered child below a layer number ("h.*.ffn.0", a Sequential's
        # member): ``*`` stands for a layer number, the other numbers for themselves.
        self.numbered_keys = [
            (re.compile(".".join(r"\d+" if p == "*" else re.escape(p) for p in k.split("."))), k)
            for k in plan
            if wildcard(k) != k
        ]
        self.modules = dict(model.named_modules())
        self.styles: dict[str, str] = {}  # concrete module or parameter name -> our style
        self.experts: dict[str, int] = {}  # experts module name -> expert count
        config = self.config = text_config(model)
        self.heads_attr = heads_attr or "num_attention_heads"
        self.heads = int(config_value(config, self.heads_attr, 0) or 0)
        # (a decoder's own count is of multi-head attention: as many kv heads as heads)
        self.kv_heads_attr = None
        if heads_attr is None:
            self.kv_heads_attr = next((a for a in _KV_HEADS_ATTRS if config_value(config, a)), None)
        kv_heads = config_value(config, self.kv_heads_attr) if self.kv_heads_attr else None
        self.kv_heads = int(kv_heads or self.heads)
        self.output_embedding = embeddings(model)[1]

    def error(self, name: str, style: str | None, why: str) -> ValueError:
        """The refusal of ``name``'s entry (``style``), or of leaving it out (``None``)."""
        model = type(self.model).__name__
        kind = type(self.modules[name]).__name__ if name in self.modules else "parameter"
        what = (
            f"leaves {name} ({kind}) out"
            if style is None
            else f"gives {name} ({kind}) the style {style!r} (plan key {wildcard(name)!r})"
        )
        fix = (_FIX_LEFT_OUT if style is None else _FIX).format(model=model)
        return ValueError(f"tsm.transform: {model}'s transformers TP plan {what}: {why}. {fix}")

    def is_attention(self, name: str) -> bool:
        return bool(re.search(r"(Attention|Attn)$", type(self.modules[name]).__name__))

    def is_kv_projection(self, name: str, module: nn.Linear) -> bool:
        parent = name.rpartition(".")[0]
        if parent not in self.modules or not self.is_attention(parent):
            return False
        head_dim = attention_head_dim(self.modules[parent], self.config)
        return 0 < self.kv_heads < self.heads and module.out_features == self.kv_heads * head_dim

    def module_style(self, name: str, module: nn.Module, style: str) -> str:
        if style == "moe_tp_experts":
            return self.experts_style(name, module, style)
        inner = [n for n, _ in module.named_parameters() if "." in n]
        if inner and (style in _LINEAR_STYLES or style in _EMBEDDING_STYLES):
            raise self.error(
                name,
                style,
                f"the module computes more than its own weight's product: its child modules "
                f"hold parameters {inner}, which would run on this rank's partial result",
            )
        if style in _CONV1D_STYLES and is_conv1d(module):
            if style == "packed_colwise":
                self.check_packed(name, module, style)
            return _CONV1D_STYLES[style]
        if style in _LINEAR_STYLES:
            if not isinstance(module, nn.Linear):
                raise self.error(
                    name,
                    style,
                    "the style splits an nn.Linear's weight (on a transformers Conv1D: "
                    f"{sorted(_CONV1D_STYLES)})",
                )
            if module is self.output_embedding and style != "rowwise":
                # Vocabulary-parallel logits and loss (tensor_parallel/loss.py) rather than
                # gathering the logits: the same values, without the vocabulary all-gather.
                # Only where the model's loss goes through the loss_function that TP replaces
                # (Note [Vocabulary-parallel logits need the model's loss_function]).
                return "lm_head" if _loss_through_loss_function(self.model) else "colwise_gather"
            if style in ("colwise", "unit_colwise") and self.is_kv_projection(name, module):
                return "kv_colwise"
            if style == "packed_colwise":
                self.check_packed(name, module, style)
            return _LINEAR_STYLES[style]
        if style in _EMBEDDING_STYLES:
            if not isinstance(module, nn.Embedding):
                raise self.error(name, style, "the style splits an nn.Embedding's weight")
            return _EMBEDDING_STYLES[style]
        if style in _MODULE_STYLES:
            return _MODULE_STYLES[style]
        raise self.error(
            name,
            style,
            "the plan-driven path has no equivalent for this style (it implements "
            f"{sorted({*_LINEAR_STYLES, *_CONV1D_STYLES, *_EMBEDDING_STYLES, *_MODULE_STYLES})}"
            " and 'moe_tp_experts')",
        )

    def check_packed(self, name: str, module: nn.Module, style: str) -> None:
        """Refuses a packed projection whose blocks are not heads' blocks (``packed_blocks``).

        Also one whose attention module splits the packed output by a full width it has no
        head size to scale by (``FULL_WIDTH_ATTRS``), unless the family's ``width_attrs``
        scale it: each rank would cut its own part at the whole model's block width.
        """
        attention = [n for n in self.modules if n and self.is_attention(n)]
        try:
            blocks = packed_blocks(self.model, name, attention)
        except ValueError as e:
            raise self.error(name, style, str(e)) from None
        if is_conv1d(module) and len(set(blocks)) > 1:
            raise self.error(
                name, style, f"a packed Conv1D splits equal blocks only, not {list(blocks)}"
            )
        owner = next((a for a in attention if name.startswith(f"{a}.")), None)
        if owner is None:
            return
        width = blocks[0]  # (the query block's: the heads' width)
        scaled = {attr for attr, _ in self.width_attrs}
        for attr, size_attr in FULL_WIDTH_ATTRS:
            if attr in scaled:
                continue
            value = getattr(self.modules[owner], attr, None)
            if value == width and not isinstance(
                getattr(self.modules[owner], size_attr, None), int
            ):
                raise self.error(
                    name,
                    style,
                    f"its attention module {owner} holds the blocks' full width in {attr!r} "
                    f"({value}) without a {size_attr!r} to scale it to this rank's heads, so "
                    "its forward would cut this rank's part at the whole width",
                )

    def experts_style(self, name: str, module: nn.Module, style: str) -> str:
        count = expert_count(module)
        if count is None:
            raise self.error(
                name,
                style,
                "its experts are not stored the way expert splitting needs (an integer "
                "num_experts and only fused parameters of shape (num_experts, ...), like "
                "transformers 5's gate_up_proj/down_proj, or expert-major rows "
                "(num_experts x rows, ...) on a child module, like DBRX's)",
            )
        arity = len(inspect.signature(type(module).forward).parameters) - 1
        if arity not in (1, 3):
            raise self.error(
                name,
                style,
                "its forward takes neither (hidden_states, top_k_index, top_k_weights), the "
                "routed experts interface, nor (rows), one block of rows per expert",
            )
        self.experts[name] = count
        if arity == 1:
            return "experts_batched"
        model_type = getattr(self.config, "model_type", None) or ""
        if experts_without_sentinel(model_type):
            return "experts_allreduce_local_slots"
        return "experts_allreduce"

    def style_of(self, name: str) -> str | None:
        """The plan's style for the module or parameter ``name``, or ``None``."""
        style = self.plan.get(wildcard(name))
        if style is None:
            key = next((k for rx, k in self.numbered_keys if rx.fullmatch(name)), None)
            style = self.plan[key] if key is not None else None
        return style

    def translate(self) -> None:
        module_styles = {}
        for name, module in self.modules.items():
            style = self.style_of(name) if name else None
            if style is not None:
                module_styles[name] = self.module_style(name, module, style)
        # Bare parameters first: an owner's local_params / reduce_output (applied after) uses
        # their split.
        self.styles = self.parameter_styles(module_styles)
        self.styles.update(module_styles)

    def parameter_styles(self, module_styles: dict[str, str]) -> dict[str, str]:
        styles = {}
        for name, module in self.modules.items():
            for pname, _ in module.named_parameters(recurse=False):
                full = f"{name}.{pname}" if name else pname
                style = self.style_of(full)
                if style is None:
                    continue
                if name in self.experts:
                    if style not in _EXPERT_PARAMETER_STYLES:
                        raise self.error(full, style, "experts are split whole, by expert")
                    continue  # the experts style splits every parameter of the module
                if module_styles.get(name, "local_params") not in ("local_params", "reduce_output"):
                    raise self.error(
                        full,
                        style,
                        f"its module already has the style {module_styles[name]!r}, which "
                        "splits the module's parameters itself",
                    )
                if style not in _PARAMETER_STYLES:
                    raise self.error(
                        full, style, f"on a bare parameter only {sorted(_PARAMETER_STYLES)} apply"
                    )
                styles[full] = _PARAMETER_STYLES[style]
        return styles

    def replicate_the_rest(self) -> None:
        """``replicate_local`` at the root of every subtree the plan leaves out entirely.

        A module whose own parameters no entry covers, with split projections below it,
        mixes those parameters with split activations in ways the plan does not describe:
        refused. Every other left-out module is replicated as part of the largest planless
        subtree holding it (its root swaps the whole subtree's parameters, so a mixer that
        reads its convolution's weight directly works); the replication is checked on first
        use (Note [Replicated module check]).
        """
        planned = set(self.styles) | set(self.experts)

        def has_planned_below(name: str) -> bool:
            prefix = f"{name}." if name else ""
            return any(p.startswith(prefix) and p != name for p in planned)

        split = [n for n, s in self.styles.items() if s in _SPLIT_OUTPUT]
        owners: list[str] = []  # modules with planned modules below and no parameters
        for name, module in self.modules.items():
            if name in planned or any(name.startswith(f"{e}.") for e in self.experts):
                continue
            own = [
                p
                for p, _ in module.named_parameters(recurse=False)
                if (f"{name}.{p}" if name else p) not in planned
            ]
            below = has_planned_below(name)
            if own and any(s.startswith(f"{name}.") for s in split):
                raise self.error(
                    name,
                    None,
                    f"its own parameters {own} have no entry, but it holds projections "
                    "whose output is split over the tensor parallel ranks, so its forward may "
                    "use them on this rank's part only; the plan does not say, so they are "
                    "not replicated silently",
                )
            if below:
                if own:  # its own parameters only; the planned modules below keep theirs
                    self.styles[name] = "local_params"
                elif name and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
                    owners.append(name)
                continue
            if not any(True for _ in module.parameters()):
                continue
            parent = name.rpartition(".")[0]
            container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
            if container:
                continue  # no forward of its own: its children are the roots
            if (
                parent in self.modules
                and not has_planned_below(parent)
                and not isinstance(self.modules[parent], (nn.ModuleList, nn.ModuleDict))
            ):
                continue  # inside a larger planless subtree
            self.styles[name] = "replicate_local"
        # A module whose forward may read a replicated child's weight directly, or call one
        # of its methods: it sees plain values too (``local_params``, Note [Plan-driven layout]).
        layers = {n for n, m in self.modules.items() if type(m).__name__ == self.layer_class}
        for name in owners:
            if any(
                style == "replicate_local"
                and root.startswith(f"{name}.")
                and not any(
                    root == layer or root.startswith(f"{layer}.") for layer in layers - {name}
                )
                for root, style in self.styles.items()
            ):
                self.styles[name] = "local_params"


def _loss_through_loss_function(model: nn.Module) -> bool:
    """Whether ``model``'s forward computes its loss with ``self.loss_function``.

    Note [Vocabulary-parallel logits need the model's loss_function]: the ``lm_head`` style
    leaves the logits split over the vocabulary, and ``apply_tp_plan`` installs the
    vocabulary-parallel loss as the model's ``loss_function``. Most causal LMs of
    transformers compute their loss through that attribute; older ones (BART's decoder and
    its relatives) call ``CrossEntropyLoss`` in their own forward, which split logits would
    reach as a DTensor and fail on. For those the output projection gathers its logits
    (``colwise_gather``): the same values, at the cost of an all-gather of the vocabulary.
    Read from the forward's source; where there is none, the gathering style, which is
    right for any forward.
    """
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return "self.loss_function" in source


def _patterns(names: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(wildcard(n) for n in names))


def _compact(styles: dict[str, str], all_names: set[str]) -> dict[str, str]:
    """Concrete names -> style, as wildcard patterns wherever a pattern says exactly that."""
    by_pattern: dict[str, dict[str, str]] = {}
    for name, style in styles.items():
        by_pattern.setdefault(wildcard(name), {})[name] = style
    out: dict[str, str] = {}
    for pattern, members in by_pattern.items():
        matched = {n for n in all_names if fnmatchcase(n, pattern)}
        if len(set(members.values())) == 1 and matched == set(members):
            out[pattern] = next(iter(members.values()))
        else:
            out.update(members)  # the pattern would reach other names: keep them concrete
    return out


def policy_from_plan(model: nn.Module) -> ModelPolicy | None:
    """The policy transformers' TP plan of ``model`` gives, or ``None`` if it has no plan.

    Where the model's plan is empty (a family transformers ships none for, and no plan set
    by the user), the plan ``shipped_plans`` gives the family (``config.model_type``) is used
    instead, if there is one and every key of it names a module of the model.

    Args:
        model: A Hugging Face model (real or meta device), not yet transformed.

    Returns:
        A ``ModelPolicy`` for this model instance (its plan lists this model's modules).

    Raises:
        ValueError: For a plan entry the translation cannot honour, or a module left out of
            the plan that may compute on split activations; naming the module, the style
            and the fix.
    """
    if not hasattr(model, "config"):
        return None
    own = with_additions(model, with_plan_experts(model, own_plan(model)))
    shipped = (not own or only_the_class_head(model, own)) and _fits(
        model, ours := shipped_from_root(model)
    )
    plan = with_tied_input_embedding(model, ours if shipped else own)
    if not plan:
        return None
    layer_class = transformer_layer_class(model, plan)
    model_type = getattr(model.config, "model_type", None) or ""
    # (a decoder's own head count where the family's config has one per stack)
    decoder_heads = heads_attr(model_type) if shipped else None
    widths = width_attrs(model_type) if shipped else ()
    t = _Translation(model, plan, layer_class, decoder_heads, widths)
    t.translate()
    t.replicate_the_rest()
    names = {n for n in t.modules if n} | {n for n, _ in model.named_parameters()}
    attention = [n for n in t.modules if n and t.is_attention(n)]
    heads_split = any(
        t.styles.get(n) in _SPLIT_OUTPUT
        for a in attention
        for n in t.modules
        if n.startswith(f"{a}.")
    )
    config = text_config(model)
    moe = None
    num_experts_attr = None
    if t.experts:
        count = next(iter(t.experts.values()))
        num_experts_attr = next(
            (a for a in _EXPERT_COUNT_ATTRS if config_value(config, a) == count), None
        )
        first = next(iter(t.experts))
        block, _, child = first.rpartition(".")
        top_k_attr = next(
            (a for a in _TOP_K_ATTRS if config_value(config, a) is not None), _TOP_K_ATTRS[0]
        )
        moe = MoESpec(
            block_class=type(t.modules[block]).__name__,
            experts=child,
            top_k_attr=top_k_attr,
            replaceable=False,
        )
    source = "shipped plan" if shipped else "transformers plan"
    return ModelPolicy(
        name=f"{model_type or type(model).__name__} ({source})",
        model_classes=(type(model).__name__,),
        layer_class=layer_class,
        attention=_patterns(attention),
        tp_plan=_compact(t.styles, names),
        num_heads_attr=t.heads_attr,
        num_kv_heads_attr=t.kv_heads_attr,
        num_experts_attr=num_experts_attr,
        moe=moe,
        sliding_window_attr="sliding_window" if hasattr(config, "sliding_window") else None,
        heads_split=heads_split,
        width_attrs=widths,
        layout_check=layout_check(model_type),
        notes=f"Built from its {source} (Note [Plan-driven layout]). "
        f"{SHIPPED_PLAN_NOTE if shipped else PLAN_TP_NOTE}",
    )


def _fits(model: nn.Module, plan: dict[str, str]) -> bool:
    """Whether every key of a shipped ``plan`` names some module of ``model``.

    (Not so for a model that holds the family's model under another prefix, a compiled one
    under ``_orig_mod``: the shipped plan is not used there. A family built around another's
    model gets a plan of its own: Fuyu's, Persimmon's under ``language_model``.)
    """
    names = [n for n, _ in model.named_modules() if n]
    return bool(plan) and all(any(fnmatchcase(n, key) for n in names) for key in plan)


__all__ = [
    "PLAN_TP_NOTE",
    "SHIPPED_PLAN_NOTE",
    "policy_from_plan",
    "wildcard",
]
