"""Known accelerators and instances, each with the public figure it comes from.

Every number here is a vendor's published figure or an assumption said to be one; the
planner never measures a GPU. ``Accelerator`` is what the time and memory models need of
one device; ``Instance`` is a host: its accelerators and its NICs.

Memory: the datasheets' "80GB" and so on, read as GiB (the parts hold that many 2^30-byte
gigabytes; the driver keeps a little of it, which ``Cluster.usable_memory`` leaves room for).
Dense figures only: NVIDIA's datasheets print the bf16 Tensor Core rate "with sparsity"
(2:4 structured sparsity, which training does not use) and give the dense rate as half.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class Accelerator:
    """What the planner needs to know about one accelerator.

    Attributes:
        name: Short name (``"H100"``).
        memory_bytes: Device memory.
        bf16_flops: Dense bf16 matrix-multiply rate, FLOP/s (the peak; the time model
            applies an efficiency to it).
        fp32_flops: Dense fp32 matrix-multiply rate (for ``dtype=float32`` training).
        memory_bandwidth: Device memory bandwidth, bytes/s (elementwise work and the
            optimizer step are bound by it).
        link_rate: Bytes/s each accelerator sends to the others of its host, one
            direction (NVLink: half the bidirectional figure datasheets print).
        host_rate: Bytes/s between the accelerator and host memory, one direction (PCIe:
            half the bidirectional figure), which activation offloading uses.
    """

    name: str
    memory_bytes: int
    bf16_flops: float
    fp32_flops: float
    memory_bandwidth: float
    link_rate: float
    host_rate: float = 0.0

    def __post_init__(self) -> None:
        """Refuses what no accelerator has: no memory, no FLOP/s, infinite or negative rates."""
        rates = {
            "memory_bytes": (self.memory_bytes, True),
            "bf16_flops": (self.bf16_flops, True),
            "fp32_flops": (self.fp32_flops, True),
            "memory_bandwidth": (self.memory_bandwidth, True),
            "link_rate": (self.link_rate, False),  # 0: no link between a host's ranks (CPU)
            "host_rate": (self.host_rate, False),  # 0: no offloading copies to price
        }
        for key, (value, positive) in rates.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"accelerator {self.name!r}: {key}={value!r} must be a number.")
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise ValueError(
                    f"accelerator {self.name!r}: {key}={value!r} must be a "
                    f"{'positive' if positive else 'non-negative'}, finite number."
                )

    def flops(self, dtype: str) -> float:
        """Peak matrix-multiply rate in ``dtype`` (``"bfloat16"`` or ``"float32"``)."""
        return self.fp32_flops if dtype == "float32" else self.bf16_flops


ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s; BF16 Tensor Core
    # 1,979 TFLOPS "with sparsity" (989.5 dense); TF32 989 with sparsity (494.5 dense; fp32
    # matmuls run as TF32 under torch.backends.cuda.matmul.allow_tf32); NVLink 900 GB/s;
    # PCIe Gen5 128 GB/s. https://www.nvidia.com/en-us/data-center/h100/
    "H100": Accelerator("H100", 80 * GIB, 989.5e12, 494.5e12, 3.35e12, 450e9, 64e9),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s; the H100's
    # compute (BF16 1,979 TFLOPS with sparsity); NVLink 900 GB/s; PCIe Gen5 128 GB/s.
    # https://www.nvidia.com/en-us/data-center/h200/
    "H200": Accelerator("H200", 141 * GIB, 989.5e12, 494.5e12, 4.8e12, 450e9, 64e9),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): BF16 Tensor Core 312 TFLOPS dense
    # (624 with sparsity), TF32 156 dense; 40 GB HBM2 at 1,555 GB/s or 80 GB HBM2e at
    # 2,039 GB/s; NVLink 600 GB/s; PCIe Gen4 64 GB/s.
    # https://www.nvidia.com/en-us/data-center/a100/
    "A100-40GB": Accelerator("A100-40GB", 40 * GIB, 312e12, 156e12, 1.555e12, 300e9, 32e9),
    "A100-80GB": Accelerator("A100-80GB", 80 * GIB, 312e12, 156e12, 2.039e12, 300e9, 32e9),
}
ACCELERATOR_ALIASES = {"A100": "A100-40GB", "A100-40": "A100-40GB", "A100-80": "A100-80GB"}


@dataclass(frozen=True)
class Instance:
    """A host: its accelerators and its network.

    Attributes:
        name: The instance type.
        accelerator: Key of ``ACCELERATORS``.
        per_host: Accelerators per host.
        nics: Network interfaces per host.
        nic_bits: Each interface's rate, bits/s.
    """

    name: str
    accelerator: str
    per_host: int
    nics: int
    nic_bits: float


INSTANCES: dict[str, Instance] = {
    # Amazon EC2 P5 instances: p5.48xlarge, 8 x H100 80 GB, 3,200 Gbps of EFAv2 networking
    # (32 x 100 Gbps interfaces). https://aws.amazon.com/ec2/instance-types/p5/
    "p5.48xlarge": Instance("p5.48xlarge", "H100", 8, 32, 100e9),
    # The same page: p5e.48xlarge, 8 x H200 141 GB, 3,200 Gbps EFA.
    "p5e.48xlarge": Instance("p5e.48xlarge", "H200", 8, 32, 100e9),
    # Amazon EC2 P4 instances: p4d.24xlarge, 8 x A100 40 GB, 400 Gbps EFA (4 x 100 Gbps);
    # p4de.24xlarge, 8 x A100 80 GB, the same network.
    # https://aws.amazon.com/ec2/instance-types/p4/
    "p4d.24xlarge": Instance("p4d.24xlarge", "A100-40GB", 8, 4, 100e9),
    "p4de.24xlarge": Instance("p4de.24xlarge", "A100-80GB", 8, 4, 100e9),
}


def accelerator(name: str) -> Accelerator:
    """The preset called ``name`` (case-insensitive; ``A100`` is the 40 GB part).

    Raises:
        ValueError: For an unknown name, listing the known ones.
    """
    key = name.strip().upper().replace("_", "-")
    key = ACCELERATOR_ALIASES.get(key, key)
    for known, acc in ACCELERATORS.items():
        if known.upper() == key:
            return acc
    raise ValueError(
        f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)} (A100 = A100-40GB). "
        "Give the numbers instead (memory, bf16 FLOP/s)."
    )


def instance(name: str) -> Instance:
    """The instance preset called ``name``.

    Raises:
        ValueError: For an unknown name, listing the known ones.
    """
    try:
        return INSTANCES[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown instance type {name!r}; known: {', '.join(INSTANCES)}. Give the "
            "accelerator, accelerators per host and the NICs instead."
        ) from None


__all__ = ["ACCELERATORS", "INSTANCES", "Accelerator", "Instance", "accelerator", "instance"]
