"""Copying from another process's memory: cross-memory attach against memcpy.

``python -m benchmarks cross_memory [--mib 64] [--pieces 256K,1M] [--repeat 5]``

A forked child copies its parent's buffer into its own in pieces, three ways, and prints
the rate of each (median of ``--repeat``):

- ``process_vm_readv``: Linux's cross-memory attach, one system call per piece, straight from
  the parent's private memory;
- one ``memcpy`` per piece from a shared mapping (what a peer's read of a pooled operand costs,
  Note [Read from the pool] in csrc/smddp/algorithms/shm_algos.h), the baseline;
- two ``memcpy`` per piece through a 1 MiB buffer: the shared-memory segment's way, where the
  owner copies in and the reader copies out.

Each with the buffers on 4 KiB pages and, where the kernel gives them, on transparent huge
pages. Whether cross-memory attach could replace the segment's two copies for ordinary
tensors is the question it answers: docs/log/multi_node.md, "At the machine's own rate".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import time

_LIBC = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _buffer(nbytes: int, huge: bool, fill: int) -> tuple[mmap.mmap, int]:
    """An anonymous private mapping, touched, and its address."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    m.write(bytes([fill]) * nbytes)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def _rates(src: int, nbytes: int, piece: int, huge: bool, repeat: int) -> dict[str, float]:
    """In a child of the process that owns ``src``: GB/s of each way of copying it."""
    parent = os.getppid()
    dst_map, dst = _buffer(nbytes, huge, 2)
    stage_map, stage = _buffer(1 << 20, huge, 3)
    readv = _LIBC.process_vm_readv
    readv.restype = ctypes.c_ssize_t
    local, remote = _IoVec(), _IoVec()

    def cma() -> None:
        for off in range(0, nbytes, piece):
            local.base, local.len = dst + off, piece
            remote.base, remote.len = src + off, piece
            got = readv(parent, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if got != piece:
                raise OSError(ctypes.get_errno(), f"process_vm_readv returned {got}")

    def one() -> None:
        for off in range(0, nbytes, piece):
            ctypes.memmove(dst + off, src + off, piece)

    def two() -> None:
        for off in range(0, nbytes, piece):
            at = stage + off % (1 << 20)
            ctypes.memmove(at, src + off, piece)
            ctypes.memmove(dst + off, at, piece)

    out = {}
    for name, fn in (("process_vm_readv", cma), ("memcpy", one), ("two memcpy", two)):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(times) / 1e9
    dst_map.close()
    stage_map.close()
    return out


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main(argv: list[str] | None = None) -> int:
    """Prints the table; returns 2 where the kernel has no cross-memory attach."""
    p = argparse.ArgumentParser(prog="python -m benchmarks cross_memory", description=__doc__)
    p.add_argument("--mib", type=int, default=64, help="bytes copied per run, in MiB")
    p.add_argument("--pieces", default="256K,1M", help="bytes per copy, comma-separated")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    if not hasattr(_LIBC, "process_vm_readv"):
        print("this C library has no process_vm_readv")
        return 2
    nbytes = args.mib << 20
    print(
        f"{args.mib} MiB copied from the parent's memory by a forked child, median of {args.repeat}"
    )
    print(
        "| pages | piece | process_vm_readv GB/s | memcpy GB/s (baseline) | two memcpy GB/s "
        "| process_vm_readv / two memcpy |"
    )
    print("|---|---|---|---|---|---|")
    for huge in (False, True):
        src_map, src = _buffer(nbytes, huge, 1)
        for piece in (_size(x) for x in args.pieces.split(",")):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the reader
                os.close(r)
                try:
                    line = json.dumps(
                        _rates(src, nbytes - nbytes % piece, piece, huge, args.repeat)
                    )
                except OSError as e:
                    line = json.dumps({"error": str(e)})
                os.write(w, line.encode())
                os._exit(0)
            os.close(w)
            with os.fdopen(r) as f:
                got = json.loads(f.read())
            os.waitpid(pid, 0)
            pages = "huge" if huge else "4 KiB"
            if "error" in got:
                print(f"| {pages} | {piece >> 10} KiB | {got['error']} | | | |")
                continue
            cma, one, two = got["process_vm_readv"], got["memcpy"], got["two memcpy"]
            cells = f"{cma:.1f} | {one:.1f} | {two:.1f} | {cma / two:.2f}"
            print(f"| {pages} | {piece >> 10} KiB | {cells} |")
        src_map.close()
    return 0
