"""What Hugging Face's building blocks save for backward, as ``Saved`` terms per token.

Families compose their ``ActivationProfile`` from these. Each term is what PyTorch's autograd
keeps of the block's ops in transformers 5 (a ``saved_tensors_hooks`` listing on CPU, every
storage once); the parallelism planner multiplies them by the tokens a rank holds.

- ``RMS_NORM``: ``LlamaRMSNorm`` and its copies upcast the input to float32 (the square and
  the scaling save it), save the float32 reciprocal root, and multiply the weight by the
  normalized value cast back to the compute dtype (saved).
- ``LAYER_NORM``: ``nn.LayerNorm`` saves its input and a float32 mean and reciprocal
  standard deviation per token.
- ``NORM_OUTPUT``: a norm's output, saved by the linears that read it; under tensor
  parallelism it is the all-gathered input of the next parallel region.
- ``SDPA``: ``scaled_dot_product_attention``'s flash kernels (CPU and CUDA) save the query,
  key and value after rotary embedding, the output and a float32 log-sum-exp per head;
  grouped-query attention passes the key/value heads unrepeated. The output projection
  reads the output itself.
- ``GATED_MLP``: ``down(act(gate(x)) * up(x))`` saves the gate's output (the activation's
  input), the activation's output, the up projection's output and their product.
- ``PLAIN_MLP``: ``fc2(act(fc1(x)))`` saves fc1's output and the activation's output.
"""

from __future__ import annotations

from torch_sagemaker.policies.model_policy import Saved

RMS_NORM: tuple[Saved, ...] = (
    Saved("hidden", "float32", "sequence"),
    Saved("one", "float32", "sequence"),
    Saved("hidden", "compute", "sequence"),
)
LAYER_NORM_INPUT: tuple[Saved, ...] = (Saved("hidden", "compute", "sequence"),)
LAYER_NORM_STATS: tuple[Saved, ...] = (Saved("one", "float32", "sequence", 2),)
LAYER_NORM: tuple[Saved, ...] = LAYER_NORM_INPUT + LAYER_NORM_STATS
NORM_OUTPUT: tuple[Saved, ...] = (Saved("hidden", "compute", "gathered"),)
SDPA: tuple[Saved, ...] = (
    Saved("q"),
    Saved("kv", count=2),
    Saved("heads", "float32"),
    Saved("q"),
)
GATED_MLP: tuple[Saved, ...] = (Saved("mlp", count=4),)
PLAIN_MLP: tuple[Saved, ...] = (Saved("mlp", count=2),)

#: A Llama-shaped decoder layer's attention half, and its dense MLP half.
LLAMA_ATTENTION: tuple[Saved, ...] = RMS_NORM + NORM_OUTPUT + SDPA
LLAMA_MLP: tuple[Saved, ...] = RMS_NORM + NORM_OUTPUT + GATED_MLP
LLAMA_FINAL: tuple[Saved, ...] = RMS_NORM + NORM_OUTPUT

#: Transformers 5's fused-experts MoE block (Mixtral and its copies) after its norm: the
#: router's float32 softmax over the experts, the top-k indices, the renormalisation's sum
#: and values; then per (token, expert) row, the grouped-GEMM experts' sort indices (three
#: int64), the gathered input, the fused gate/up output, the activation's output, their
#: product, the row's routing weight and the expert output it scales.
TOPK_ROUTER: tuple[Saved, ...] = (
    Saved("experts", "float32", "gathered"),
    Saved("topk", "int64", "gathered"),
    Saved("one", "float32", "gathered"),
    Saved("topk", "float32", "gathered"),
)
GROUPED_EXPERTS: tuple[Saved, ...] = (
    Saved("one", "int64", "routed", 3),
    Saved("hidden", "compute", "routed", 2),
    Saved("expert_mlp", "compute", "routed", 4),
    Saved("one", "float32", "routed"),
)

__all__ = [
    "GATED_MLP",
    "GROUPED_EXPERTS",
    "LAYER_NORM",
    "LAYER_NORM_INPUT",
    "LAYER_NORM_STATS",
    "LLAMA_ATTENTION",
    "LLAMA_FINAL",
    "LLAMA_MLP",
    "NORM_OUTPUT",
    "PLAIN_MLP",
    "RMS_NORM",
    "SDPA",
    "TOPK_ROUTER",
]
