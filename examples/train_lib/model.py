"""Builds a Hugging Face config and model for each ``--model-type``, from arguments only."""

from __future__ import annotations

import argparse

from transformers import (
    AutoModelForCausalLM,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
)

from .data import VOCAB_SIZE


def build_config(args: argparse.Namespace) -> PretrainedConfig:
    """The model config for ``args.model_type``; byte-level vocabulary, no dropout."""
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden_width,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=max(args.max_context_width, 128),
        initializer_range=args.initializer_range,
        use_cache=False,
        tie_word_embeddings=False,
    )
    kv = args.num_key_value_heads
    if args.model_type == "gpt_neox":
        return GPTNeoXConfig(
            **common,
            rope_parameters={
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "rope_type": "default",
            },
        )
    if args.model_type == "llama_v2":
        return LlamaConfig(**common, num_key_value_heads=args.num_heads)
    if args.model_type == "llama_v3":
        # Llama 3 shape: grouped-query attention and a large RoPE base with llama3 scaling.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(**common, num_key_value_heads=kv, rope_parameters=rope)
    if args.model_type == "mistral":
        return MistralConfig(**common, num_key_value_heads=kv, sliding_window=None)
    if args.model_type == "mixtral":
        return MixtralConfig(
            **common,
            num_key_value_heads=kv,
            num_local_experts=args.num_local_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            router_aux_loss_coef=0.001,
        )
    if args.model_type == "qwen2":
        return Qwen2Config(**common, num_key_value_heads=kv)
    raise ValueError(f"unknown --model-type {args.model_type!r}")


def moe_config(args: argparse.Namespace):
    """The MoEConfig handed to ``tsm.transform`` with ``--moe 1`` (as SMP's scripts build it), else
    None."""
    if not args.moe:
        return None
    from torch.sagemaker.moe.moe_config import MoEConfig

    return MoEConfig(
        smp_moe=True,
        moe_load_balancing=args.moe_load_balancing,
        global_token_shuffle=args.global_token_shuffle,
        moe_all_to_all_dispatcher=args.moe_all_to_all_dispatcher,
    )


def build_model(config: PretrainedConfig):
    """An fp32 causal LM from ``config`` (on the current default device, e.g. meta)."""
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
