"""The cost model's element types: bytes per element, and what a reduction puts on the wire.

The half-precision half of the cost model (cost_model.py prices the calls with it).
"""

from __future__ import annotations

# Note [Cost model of half precision]
# A bf16 or fp16 collective of S bytes (S/2 elements) puts on the wire what an fp32 one of S
# bytes does: smddp sends partial sums between hosts in the tensor's own dtype (Note [Half
# precision on the wire] in csrc/smddp/algorithms/net_algorithm.h), so the NIC, TCP and
# message terms count S, cut into CHUNK_BYTES messages of the wire's bytes. With
# SMDDP_NET_REDUCE_DTYPE=fp32 (``wire="float32"``) a reduction's partials cross in fp32:
# twice the bytes and messages. An all_gather moves the tensor's bytes whatever the setting.
# What differs is the CPU's work per byte: twice the elements per byte, each widened to fp32
# where it is summed. So each byte a reduction reads is priced in the type it is read in:
#   - the shared-memory reduce-scatter reads S of the tensor's bytes per rank and sums them
#     in fp32: half_shm_reduce_cpu per input byte. The partials that leave the host are then
#     rounded to the wire type, (H-1)/N S elements, priced within that rate: it is 1/4 of
#     the input on 2x2 and 3/8 on 4x2 (where the rate is fitted), 1/8 on hosts of 8 ranks;
#   - the exchange's reduction reads what arrived in the wire type and the rank's own
#     partial: the input itself with one rank per host (the tensor's bytes), else the fp32
#     sums of the shared-memory steps (fp32 bytes, at reduce_cpu); every half-precision
#     byte costs half_reduce_cpu;
#   - with one rank per host and fp32 on the wire, the input is first widened into fp32
#     partials: S of input at half_shm_reduce_cpu;
#   - copies (the shared-memory all-gather, an all_gather's own part) move bytes whatever
#     they hold: copy_cpu for every dtype.
# gloo's flat ring is priced as it is for fp32, its bytes in the tensor's dtype; its bf16
# reduction is its own code, and its bf16 rows are not claimed (cost_model_fit.modelled).

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACCUMULATE_BYTES = 4  # bf16/fp16 partial sums are kept in fp32


def element_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype``.

    Args:
        dtype: torch's name: ``float32``, ``bfloat16`` or ``float16``.

    Raises:
        ValueError: Another dtype.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(
            f"dtype={dtype!r}: the cost model prices {', '.join(DTYPE_BYTES)} only; "
            "pass one of these (torch's names)"
        )
    return DTYPE_BYTES[dtype]


def wire_bytes(op: str, dtype: str = "float32", wire: str | None = None) -> int:
    """Bytes per element that ``op`` on ``dtype`` puts on the wire.

    Note [Cost model of half precision] says why.

    Args:
        op: One of OPS.
        dtype: The tensor's dtype.
        wire: The type reductions send partial sums in: None (the tensor's own, smddp's
            default) or ``float32`` (``SMDDP_NET_REDUCE_DTYPE=fp32``).

    Raises:
        ValueError: An unknown dtype, or a wire type other than the tensor's own or float32.
    """
    own = element_bytes(dtype)
    if wire is None or op == "all_gather_into_tensor":
        return own
    if wire not in (dtype, "float32"):
        raise ValueError(
            f"wire={wire!r} for a {dtype} reduction: partial sums cross in the tensor's own "
            "dtype or in float32 (SMDDP_NET_REDUCE_DTYPE); pass None or 'float32'"
        )
    return element_bytes(wire)
