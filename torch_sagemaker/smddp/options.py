"""Typed options of an smddp process group, and the table of every setting.

Pass them as ``pg_options`` when a group is created::

    from torch_sagemaker.smddp import SMDDPOptions
    dist.init_process_group("smddp", pg_options=SMDDPOptions(buffer_bytes="4M"))
    g = dist.new_group(ranks, pg_options=SMDDPOptions(spin_us=0))

A field left at ``None`` takes its environment variable (``SMDDP_*``), else its default.
The backend reads and checks both sources in one place (``csrc/smddp/common/settings.cpp``, Note
[Settings]): a malformed value ("12x", "-1", a size out of range) raises ``ValueError`` at
group creation, naming the option or variable, the value and the rule. That C++ table is
also the source of the settings table in docs/collectives.md (``settings_markdown``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class SMDDPOptions:
    """Options of one smddp process group (``pg_options``); ``None`` means "not set here".

    Byte sizes are ints or strings with a K, M, G or T suffix ("64K", "1M"). The rules and
    defaults are those of the settings table in docs/collectives.md.

    Attributes:
        buffer_bytes: Each of the two shared-memory data buffers per rank (4K to 1G).
        chunk_bytes: Bytes per rank per pipelined step, or "auto".
        oneshot_bytes: all_reduce up to this size runs the one-shot algorithm.
        pool_bytes: Address space of each rank's tensor pool (0: no pool).
        p2p_bytes: Ring per ordered pair of local ranks for send/recv (0: over TCP).
        stream_bytes: Per-rank output size from which copies use streaming stores (0:
            never), or "auto".
        spin_us: Busy-wait budget before sleeping, caller thread.
        worker_spin_us: Busy-wait budget before sleeping, async worker threads.
        move_off_cpu: Let a waiting thread move itself off a CPU its peer shares (changes
            its CPU affinity for an instant; off unless asked for).
        force_local_size: Treat blocks of k consecutive global ranks as separate hosts.
        socket_addr: IPv4 address (or name) other hosts reach this rank at.
        socket_ifname: Network interface whose IPv4 address to use instead.
        net_chunk_bytes: Collectives across hosts send each part in messages of this size.
        net_algo: How collectives cross hosts: "mesh", "ring", "halving_doubling", "tree"
            (all_reduce only; other collectives as "auto") or "auto".
        net_reduce_dtype: The type bf16/fp16 reductions send partial sums between hosts in:
            "auto" (their own, half of fp32's bytes) or "fp32".
        connect_attempt_timeout: How long one attempt to connect to another rank over TCP
            waits for the network's answer before it is made afresh (seconds or
            timedelta, 0.1 to 60 s).
        timeline: Record when each collective and its phases across hosts began and ended,
            and the phases of staged calls on device tensors.
        staging_chunk_bytes: Device tensors: bytes copied and reduced at a time (4K to 1G).
        staging_memory: Device tensors: host memory the copies land in, "auto", "pinned"
            or "pool".
        stage_cpu: CPU tensors take the device staging path too (tests of its pipeline).
        timeout: Timeout of the group's set-up and collectives (seconds or timedelta),
            instead of the one given to ``init_process_group`` / ``new_group``.
    """

    buffer_bytes: int | str | None = None
    chunk_bytes: int | str | None = None
    oneshot_bytes: int | str | None = None
    pool_bytes: int | str | None = None
    p2p_bytes: int | str | None = None
    stream_bytes: int | str | None = None
    spin_us: int | None = None
    worker_spin_us: int | None = None
    move_off_cpu: bool | None = None
    force_local_size: int | None = None
    socket_addr: str | None = None
    socket_ifname: str | None = None
    net_chunk_bytes: int | str | None = None
    net_algo: str | None = None
    net_reduce_dtype: str | None = None
    connect_attempt_timeout: float | timedelta | None = None
    timeline: bool | None = None
    staging_chunk_bytes: int | str | None = None
    staging_memory: str | None = None
    stage_cpu: bool | None = None
    timeout: float | timedelta | None = None

    def _smddp_overrides(self) -> dict[str, str]:
        """The fields that are set, as the text the backend parses (called by the backend)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if isinstance(value, timedelta):
                value = value.total_seconds()
            if isinstance(value, bool) and field.name in _FLAGS:
                value = int(value)
            out[field.name] = str(value)
        return out


# The flags (fields typed ``bool | None``) are the fields where True and False mean 1 and 0.
# Elsewhere a bool is a mistake: its text ("True") reaches the backend's parser, which names
# the field and the rule, instead of being read as the count or size 1.
_FLAGS = frozenset(f.name for f in dataclasses.fields(SMDDPOptions) if f.type == "bool | None")


def setting_table() -> list[dict[str, str]]:
    """Every setting of the backend: field, environment variable, kind, default, meaning."""
    from torch_sagemaker import _C

    return _C.setting_table()


def settings_markdown() -> str:
    """The settings table of docs/collectives.md, generated from the backend's own table."""
    lines = [
        "| `SMDDPOptions` field | environment variable | kind | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for row in setting_table():
        env = f"`{row['env']}`" if row["env"] else "-"
        default = row["default"] or "unset"
        lines.append(f"| `{row['field']}` | {env} | {row['kind']} | {default} | {row['meaning']} |")
    return "\n".join(lines) + "\n"


def resolve(options: SMDDPOptions | None, environ: dict[str, str]) -> dict[str, str]:
    """What a group would use, given ``options`` and an environment (for tests and docs).

    Raises:
        ValueError: A value breaks its rule (the message names it).
    """
    from torch_sagemaker import _C

    return _C._resolve_settings(options._smddp_overrides() if options else {}, environ)


def _write_docs_table(path: str) -> None:
    """Replaces the generated settings table in ``path`` (docs/collectives.md)."""
    begin, end = (
        "<!-- settings table: generated, do not edit -->\n",
        "<!-- end of settings table -->",
    )
    with open(path) as f:
        text = f.read()
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    with open(path, "w") as f:
        f.write(head + begin + settings_markdown() + end + tail)


if __name__ == "__main__":
    import os

    _write_docs_table(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "collectives.md"))
