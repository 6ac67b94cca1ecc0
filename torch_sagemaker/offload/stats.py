"""Counters of activation offloading, readable per step and easy to log.

``StatsRecorder`` is updated by the engine; ``OffloadStats`` is an immutable snapshot of it.
"Resident" bytes are the bytes of saved activations of wrapped layers that the engine
holds on the compute device: storages not yet offloaded (or whose copy is in flight),
storages fetched back for the backward, and storages kept on the device (small ones and
ones saved by several layers). Tensors saved outside the wrapped layers are counted
separately and never offloaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class OffloadStats:
    """Activation offloading counters since the last reset (normally one training step).

    Attributes:
        forward_passes: Forward passes of the wrapped root that recorded activations.
        layers: Layer calls (units) seen in those passes.
        bytes_saved: Bytes of distinct storages saved by wrapped layers (what stays
            resident when nothing is offloaded).
        bytes_offloaded: Bytes copied from the compute device to host memory.
        bytes_prefetched: Bytes copied back before the layer's backward started.
        bytes_fetched_on_demand: Bytes copied back only when the backward needed them.
        bytes_kept: Bytes saved by wrapped layers but kept on the device: storages below
            the size threshold, saved by several layers, of tensor types that cannot be
            copied byte for byte, or not on the model's device type (e.g. CPU tensors in a
            CUDA run).
        bytes_outside_layers: Bytes saved outside the wrapped layers (never offloaded).
        resident_bytes: Resident bytes now.
        peak_resident_bytes: Highest resident bytes since the reset.
        demand_fetches: Layers whose backward started before they had been requested.
        late_fetches: Fetched buffers whose copy had not finished when first used (CUDA).
        prefetch_lead_max: Most layers resident or in flight ahead of a running backward.
        prefetch_lead_mean: Mean of that lead over the layers' backward starts.
        wait_seconds: Host time spent blocked waiting for copies (on the synchronous path,
            the copies made on demand).
        copy_seconds: Host time spent issuing copies (all of it is copying on the CPU).
        host_pool_bytes: Bytes owned by the host buffer pools now (in use and free). Free
            blocks are trimmed whenever a pool becomes idle (after each forward/backward
            pair) to at most twice the bytes the largest of the last 4 such cycles used
            (Note [Host pool trimming] in ``buffers.py``), so it stays bounded when shapes
            vary.
        host_pool_new_bytes: Bytes of host blocks allocated since the reset (pinned on
            CUDA). 0 after the first step at fixed shapes; under shapes that vary it counts
            the sizes the pool could not reuse.
    """

    forward_passes: int = 0
    layers: int = 0
    bytes_saved: int = 0
    bytes_offloaded: int = 0
    bytes_prefetched: int = 0
    bytes_fetched_on_demand: int = 0
    bytes_kept: int = 0
    bytes_outside_layers: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    demand_fetches: int = 0
    late_fetches: int = 0
    prefetch_lead_max: int = 0
    prefetch_lead_mean: float = 0.0
    wait_seconds: float = 0.0
    copy_seconds: float = 0.0
    host_pool_bytes: int = 0
    host_pool_new_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        """The counters as a flat dict (for loggers such as TensorBoard or wandb)."""
        return asdict(self)

    def summary(self) -> str:
        """A one-line human-readable summary."""
        mib = 1 << 20
        return (
            f"offload: {self.layers} layers, offloaded {self.bytes_offloaded / mib:.2f} MiB, "
            f"peak resident {self.peak_resident_bytes / mib:.2f} MiB "
            f"(of {self.bytes_saved / mib:.2f} MiB saved, {self.bytes_kept / mib:.2f} MiB kept), "
            f"lead {self.prefetch_lead_max}, demand fetches {self.demand_fetches}, "
            f"wait {self.wait_seconds * 1e3:.1f} ms"
        )


class StatsRecorder:
    """Mutable counters behind ``OffloadStats``; updated by the engine."""

    def __init__(self) -> None:
        self.resident_bytes = 0
        self.reset()

    def reset(self) -> None:
        """Starts a new period; the resident bytes carry over and seed the peak."""
        # OffloadStats's numeric fields (ints and floats) by name, from their defaults.
        self._counts: dict[str, Any] = {f.name: f.default for f in fields(OffloadStats)}
        self._counts["peak_resident_bytes"] = self.resident_bytes
        self._lead_sum = 0
        self._lead_count = 0

    def add(self, name: str, amount: float = 1) -> None:
        """Adds ``amount`` to the counter ``name``."""
        self._counts[name] += amount

    def change_resident(self, delta: int) -> None:
        """Moves the resident byte count by ``delta`` and updates the peak."""
        self.resident_bytes += delta
        assert self.resident_bytes >= 0, f"resident bytes went negative ({self.resident_bytes})"
        if self.resident_bytes > self._counts["peak_resident_bytes"]:
            self._counts["peak_resident_bytes"] = self.resident_bytes

    def record_lead(self, lead: int) -> None:
        """Records the prefetch lead observed when a layer's backward started."""
        self._lead_sum += lead
        self._lead_count += 1
        self._counts["prefetch_lead_max"] = max(self._counts["prefetch_lead_max"], lead)

    def snapshot(self, host_pool_bytes: int = 0) -> OffloadStats:
        """An immutable copy of the counters."""
        counts = dict(
            self._counts, resident_bytes=self.resident_bytes, host_pool_bytes=host_pool_bytes
        )
        if self._lead_count:
            counts["prefetch_lead_mean"] = self._lead_sum / self._lead_count
        return OffloadStats(**counts)
