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
- ``SDPA_MASKED``: the same call when Hugging Face passes an explicit mask (a sliding
  window no longer than the sequence): the key and value are repeated to every query head
  first, and the kernel also saves the mask, converted to the compute dtype, per call
  (Note [Masked attention saves more]).
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
# Note [Masked attention saves more]
#     Transformers 5 passes SDPA an explicit mask only where the causal flag cannot express
#     the pattern: for a sliding window, whenever the keys are at least as many as the window
#     (``masking_utils._ignore_causal_mask_sdpa``; at ``window == seq_len`` the mask is
#     all-causal but built all the same). With a mask, ``use_gqa_in_sdpa`` is false on CUDA
#     and CPU, so ``sdpa_attention_forward`` repeats the key and value to every query head
#     (``repeat_kv``) and the kernel saves the repeated ones. The boolean mask itself is a
#     ``[1, 1, s, s]`` tensor expanded over the batch; SDPA converts it to an additive mask
#     in the query's dtype for each call, ``[b, 1, s, s]``, and saves that. Measured with a
#     ``saved_tensors_hooks`` on CPU (Mistral and Qwen2 with 16 heads, 4 kv heads, seq 512,
#     windows 128, 511, 512 and 513, float32 and bfloat16): the layers with the window save
#     two ``[b, heads, s, d]`` tensors instead of two ``[b, kv_heads, s, d]`` ones, and one
#     ``[b, 1, s, s]`` mask each; a window of 513 saves what no window saves. CUDA's
#     memory-efficient kernel pads the mask's last dimension to a multiple of 16, which this
#     leaves out.
SDPA_MASKED: tuple[Saved, ...] = (
    Saved("q"),
    Saved("q", count=2),
    Saved("heads", "float32"),
    Saved("q"),
    Saved("keys", region="gathered"),
)
GATED_MLP: tuple[Saved, ...] = (Saved("mlp", count=4),)
PLAIN_MLP: tuple[Saved, ...] = (Saved("mlp", count=2),)

#: A Llama-shaped decoder layer's attention half, and its dense MLP half.
LLAMA_ATTENTION: tuple[Saved, ...] = RMS_NORM + NORM_OUTPUT + SDPA
#: The attention half when a sliding window makes Hugging Face pass a mask.
LLAMA_ATTENTION_MASKED: tuple[Saved, ...] = RMS_NORM + NORM_OUTPUT + SDPA_MASKED
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
    "LLAMA_ATTENTION_MASKED",
    "LLAMA_FINAL",
    "LLAMA_MLP",
    "NORM_OUTPUT",
    "PLAIN_MLP",
    "RMS_NORM",
    "SDPA",
    "SDPA_MASKED",
    "TOPK_ROUTER",
]
