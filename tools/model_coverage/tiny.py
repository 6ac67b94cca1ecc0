"""Tiny configs for every causal-LM family of transformers, built locally (nothing downloaded).

``tiny_config(model_type)`` starts from the family's default config and shrinks it: hidden
64, 2 layers, 4 heads of 16 with 2 key/value heads, vocabulary 128, 4 experts (2 per token)
for mixtures of experts, no dropout; sub-configs (a multimodal model's ``text_config``,
``vision_config``) are shrunk the same way. Only the attributes the family's config knows
are set (through its ``attribute_map``, so ``n_embd`` follows ``hidden_size``).
``OVERRIDES`` holds what one family needs beyond that (sizes its config ties together); it
is test data about the families, not model knowledge the library uses.
"""

from __future__ import annotations

import re
from typing import Any

#: Sizes every family gets where its config has the attribute.
COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "use_cache": False,
    "rotary_dim": 8,
    # mixtures of experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_group": 1,
    "topk_group": 1,
    # linear attention (Kimi-Linear, Qwen3-Next)
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    # multi-head latent attention
    "q_lora_rank": 48,
    "index_topk": 8,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}

#: Token-id attributes kept inside the tiny vocabulary.
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")

#: A sequence-to-sequence family's sizes per stack.
SEQ2SEQ: dict[str, Any] = {
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
}

#: Per family: attributes beyond COMMON (its config ties other sizes to them).
OVERRIDES: dict[str, dict[str, Any]] = {
    "dots1": {"n_shared_experts": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": 128},
    "dots3_note_text": {"num_key_value_heads": 4},
    # its vision encoder's default routes experts by a 42-layer pyramid, one entry per layer
    # its vision encoder's default routes experts by a 42-layer pyramid, one entry per layer;
    # its adapters' widths to the text model are sizes of their own
    "dots3_note_vision_encoder": {
        "pyramid_num_routed": [-1, 4],
        "adapter_in_dim": 64,
        "adapter_out_dim": 64,
        "moe_intermediate_size": 32,
    },
    "dots3_note_audio_encoder": {
        "adapter_input_size": 64,
        "adapter_out_dim": 64,
        "downsample_hidden_size": 32,
        "feature_size": 16,
    },
    # its default config has no rope parameters for its (per-layer keyed) layer types
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    # transformers' DBRX reads attn_config.rope_theta, which its default sub-config lacks,
    # and clamps q/k/v by clip_qkv, which fails at None (DBRX's released config sets both);
    # and its config copies d_model into ffn_config before hidden_size (an alias) sets it
    "dbrx": {
        "d_model": 64,
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "gemma4_text": {"vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16},
    # its vision embedder's widths are sizes of its own (3840 wide, 1120 positions)
    "gemma4_unified_vision": {"mm_embed_dim": 64, "output_proj_dims": 64, "mm_posemb_size": 32},
    # its config checks that attention_types spans num_layers
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "roc_bert": {"pronunciation_embed_dim": 16, "shape_embed_dim": 16},
    # sequence-to-sequence families: sizes per stack
    **{
        f: SEQ2SEQ
        for f in (
            "bart",
            "mbart",
            "marian",
            "pegasus",
            "blenderbot",
            "blenderbot-small",
            "plbart",
            "bigbird_pegasus",
            "mvp",
        )
    },
    # its multi-query attention (the default) has one key/value head, whatever
    # num_key_value_heads says; the planner reads that attribute
    "gpt_bigcode": {"num_key_value_heads": 1},
    # likewise (the default is Falcon-7B's multi-query layout); transformers 5.25 derives the
    # attribute from multi_query, but takes a value given to it over its own
    "falcon": {"num_key_value_heads": 1},
    # GLM-4.5's per-head query and key norms (the config's default leaves them out)
    "glm4_moe": {"use_qk_norm": True},
    # (transformers 5.25) its sparse-attention indexer has at most one head per query head of
    # a key head (2 here; 12 by default)
    "kolibri1_1": {"index_num_heads": 2},
    # Whisper's config maps num_key_value_heads to its encoder's head count: 2 heads there
    # against the decoder's 4 (the causal LM is the decoder: its own count is used)
    "whisper": SEQ2SEQ,
    # BigBird's default block_sparse attention is refused at tp > 1 (shipped_plans'
    # layout check): the decoder's supported layout
    "big_bird": {"attention_type": "original_full"},
    # X-MOD's layers pick a language adapter: the inputs' or the config's default
    "xmod": {"default_language": "en_XX"},
    # Mllama's text model: its second layer attends to image states (``extra_inputs``)
    "mllama_text_model": {"cross_attention_layers": [1]},
    # its default init_std of 1.0 gives the tiny model a loss of 20 that moves by 4e-4 when
    # the weights move by 1e-7: rounding would decide the comparison, not TP
    "cpmant": {"init_std": 0.02},
    # GIT's loss skips the image's tokens, with or without an image (``extra_inputs``): a
    # small one, of 5 tokens
    "git_vision_model": {"image_size": 32, "patch_size": 16},
}


def extra_inputs(model: Any, batch: int) -> dict[str, Any]:
    """Inputs besides the token ids that a family's forward needs to run all its layers.

    Mllama's cross-attention layers run only with image states (a text-only forward skips
    them): 5 positions of random states, the same for every batch and rank. GIT's loss
    skips its image's tokens, which it counts whether or not an image is given: a random
    image, the same everywhere.
    """
    import torch

    config = model.config
    generator = torch.Generator().manual_seed(5)
    if getattr(config, "model_type", "") == "mllama_text_model":
        states = torch.randn(batch, 5, config.hidden_size, generator=generator)
        return {"cross_attention_states": states}
    if getattr(config, "model_type", "") == "git":  # its image's tokens come first
        size = config.vision_config.image_size
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=generator)}
    return {}


#: A tiny model above this many parameters means a size the shrinking did not reach.
MAX_PARAMETERS = 20_000_000

# Note [Peaked attention in the tiny models]: with transformers' usual initialisation (std
# 0.02) a 64-wide model's attention scores are about +-0.1, so every head attends almost
# uniformly, and a wrong split of the heads barely changes the output. Measured on
# OpenAI-GPT with its head count left whole on each rank (so each rank cut its 2 heads of
# 16 as 4 of 8): logits 2.7e-5 off, inside the tolerance, a "pass". ``build`` therefore
# scales the weights of the attention modules' projections (``nn.Linear``, transformers'
# ``Conv1D``) by ``ATTENTION_SCALE``: queries and keys 3x, scores 9x, about +-1; the same
# mistake is then 1.6e-3 off, a failure, while the correct split stays at 1.5e-7. (Families
# with per-head q/k norms undo the scale; their scores are about +-1 already.)
ATTENTION_SCALE = 3.0


def _has(config: Any, key: str) -> bool:
    if key in vars(config):
        return True
    try:
        return hasattr(config, key)
    except Exception:  # a property that refuses on this config (per-layer attributes)
        return False


def _shrunk_kwargs(cls: type, extra: dict[str, Any]) -> dict[str, Any]:
    default = cls()
    kwargs = {k: v for k, v in COMMON.items() if _has(default, k)}
    for key, value in list(vars(default).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            kwargs[key] = 0.0
    for key in TOKEN_IDS:
        value = vars(default).get(key)
        if isinstance(value, int) and value >= COMMON["vocab_size"]:
            kwargs[key] = COMMON["vocab_size"] - 1 - TOKEN_IDS.index(key)
    for name, sub_cls in (getattr(cls, "sub_configs", None) or {}).items():
        if sub_cls.__name__ == "AutoConfig":  # the class is the default sub-config's own
            sub_cls = type(getattr(default, name, None))
        if isinstance(sub_cls, type) and sub_cls is not type(None):
            sub_extra = OVERRIDES.get(getattr(sub_cls, "model_type", ""), {})
            kwargs[name] = sub_cls(**_shrunk_kwargs(sub_cls, sub_extra)).to_dict()
    if "qk_rope_head_dim" in kwargs:  # latent attention: the config derives its head_dim,
        kwargs.pop("head_dim", None)  # and keys and values get one head per query head
        if "num_key_value_heads" in kwargs:
            kwargs["num_key_value_heads"] = COMMON["num_attention_heads"]
    for key in list(kwargs):
        attr = getattr(cls, key, None)
        if isinstance(attr, property) and attr.fset is None:
            del kwargs[key]  # derived by the config itself
    kwargs.update(extra)
    return kwargs


def tiny_config(model_type: str):
    """The tiny config of ``model_type`` (a key of transformers' ``CONFIG_MAPPING``).

    Raises:
        Exception: Whatever the family's config raises for these sizes (the caller reports it).
    """
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return cls(**_shrunk_kwargs(cls, OVERRIDES.get(model_type, {})))


def _on_meta(cfg: Any) -> tuple[Any, str]:
    """The model of ``cfg`` on the meta device, and the attention it was built with.

    The attention is ``"sdpa"`` where the family's model supports it, else ``"eager"``. A
    multimodal model supports it only where every tower does (each sub-model's class says,
    and building it raises naming a tower without it). The model built for the choice is the
    one ``build`` checks the size of.

    Returns:
        ``(model on the meta device, "sdpa" or "eager")``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(cfg), None)
    with torch.device("meta"):
        if cls is not None and getattr(cls, "_supports_sdpa", False):
            try:
                return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"), "sdpa"
            except ValueError:  # a tower without it (transformers raises naming the tower)
                pass
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager"), "eager"


def build(model_type: str, seed: int = 0, device: str | None = None):
    """The tiny fp32 model of ``model_type`` with weights drawn from ``seed``.

    Raises:
        ValueError: If the model is not tiny (a size the shrinking did not reach).
    """
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    probe, attention = _on_meta(cfg)
    count = sum(p.numel() for p in probe.parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(
            f"the tiny config still has {count / 1e6:.1f}M parameters (a size its config "
            "keeps under another name was not shrunk)"
        )
    if device == "meta":
        return probe
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention)
    with torch.no_grad():
        # Zero-initialised parameters (routers, gates, biases) would make every expert tie
        # and hide a bias handled wrongly: give them values, the same on every rank.
        for p in model.parameters():
            if p.is_floating_point() and not p.any():
                p.normal_(0.0, 0.1)
        # (Note [Peaked attention in the tiny models]; the projections' weights, each once
        # where attention modules nest)
        matrices = {
            id(p.weight): p.weight
            for m in model.modules()
            if re.search(r"(Attention|Attn)$", type(m).__name__)
            for p in m.modules()
            if isinstance(p, nn.Linear) or type(p).__name__ == "Conv1D"
        }
        for p in matrices.values():
            p.mul_(ATTENTION_SCALE)
    return model.float()
