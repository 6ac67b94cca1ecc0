"""Benchmark of checkpoint checksums: save and load with and without them, same run.

``python -m torch_sagemaker.bench checkpoint [--mb 100 --repeats 7 --threads 1,2]`` saves a
state dict of about ``--mb`` MB (float32 tensors of a few MB each, like a small model's
layers) in one process, and compares, for each writer thread count:

- DCP alone (``dcp.save`` / ``dcp.load`` into a directory: no staging, no marker),
- ``torch_sagemaker`` save/load with the checksums switched off (the baseline: the commit
  protocol as it was before checksums, the marker holding sizes only),
- ``torch_sagemaker`` save/load as shipped (CRC-32 while writing, verified on load).

The configurations take turns within each repeat so that load from other processes
spreads evenly; the table reports medians and the ratio to the baseline. A last row gives
the raw ``zlib.crc32`` throughput on the same bytes in memory.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from torch_sagemaker.bench import comma_list


def make_state(mb: int) -> dict[str, torch.Tensor]:
    """About ``mb`` MB of float32 tensors of 4 MB each (seeded)."""
    torch.manual_seed(0)
    n = max(1, mb // 4)
    return {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(n)}


@contextlib.contextmanager
def checksums_off() -> Iterator[None]:
    """The commit protocol without computing or verifying checksums (the baseline)."""
    from torch_sagemaker.distributed.checkpoint import atomic_dir, integrity

    def write(self, data):  # the stream still counts bytes, but computes nothing
        n = self._raw.write(data)
        self.size += memoryview(data).nbytes if n is None else n
        return n

    saved = (integrity._CrcStream.write, integrity.checksums_for, atomic_dir.verify_files)
    integrity._CrcStream.write = write
    integrity.checksums_for = lambda directory, sizes, recorded: dict.fromkeys(sizes, "00000000")
    atomic_dir.verify_files = lambda path, marker, names: []
    try:
        yield
    finally:
        integrity._CrcStream.write, integrity.checksums_for, atomic_dir.verify_files = saved


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (all threads of this process) of ``fn()``."""
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def run(args: argparse.Namespace) -> list[dict]:
    """Times every configuration; returns one row per (operation, configuration, threads)."""
    import torch.distributed.checkpoint as dcp

    from torch_sagemaker.distributed.checkpoint import load, save
    from torch_sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemWriter

    state = make_state(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="tsm_bench_ckpt_", dir=args.dir))
    template = {k: torch.empty_like(v) for k, v in state.items()}
    times: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    try:
        for _ in range(args.repeats):
            for threads in args.threads:

                def writer(threads: int = threads) -> DistributedFileSystemWriter:
                    return DistributedFileSystemWriter("unused", thread_count=threads)

                plain = root / f"dcp{threads}"
                off, on = root / f"off{threads}", root / f"on{threads}"
                # Callable[..., object]: the lambdas bind the loop's values as defaults.
                cases: list[tuple[str, str, Callable[..., object]]] = [
                    (
                        "save",
                        "DCP alone",
                        lambda p=plain, w=writer: dcp.save(
                            state, storage_writer=w(), checkpoint_id=p, no_dist=True
                        ),
                    ),
                    (
                        "save",
                        "tsm, no checksums",
                        lambda p=off, w=writer: _off(
                            lambda: save(state, checkpoint_id=p, storage_writer=w())
                        ),
                    ),
                    (
                        "save",
                        "tsm, crc32",
                        lambda p=on, w=writer: save(state, checkpoint_id=p, storage_writer=w()),
                    ),
                ]
                for op, name, fn in cases:
                    times.setdefault((op, name, threads), []).append(_timed(fn))
                loads: list[tuple[str, Callable[..., object]]] = [
                    (
                        "DCP alone",
                        lambda p=plain: dcp.load(template, checkpoint_id=p, no_dist=True),
                    ),
                    (
                        "tsm, no checksums",
                        lambda p=off: _off(lambda: load(template, checkpoint_id=p)),
                    ),
                    ("tsm, crc32", lambda p=on: load(template, checkpoint_id=p)),
                ]
                for name, fn in loads:
                    times.setdefault(("load", name, threads), []).append(_timed(fn))
                if not torch.equal(template["layer0.weight"], state["layer0.weight"]):
                    raise RuntimeError("the benchmark loaded other values than it saved")
        flat = torch.cat([v.flatten() for v in state.values()]).numpy().data.cast("B")
        crc = [_timed(lambda: zlib.crc32(flat)) for _ in range(args.repeats)]
        times[("crc32", "zlib.crc32 in memory", 1)] = crc
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for (op, name, threads), ts in times.items():
        base = times.get((op, "tsm, no checksums", threads))
        med = statistics.median(t for t, _ in ts)
        rows.append(
            {
                "op": op,
                "config": name,
                "threads": threads,
                "median_s": med,
                "cpu_s": statistics.median(c for _, c in ts),
                "mb_s": nbytes / med / 1e6,
                "vs_baseline": med / statistics.median(t for t, _ in base) if base else None,
            }
        )
    return rows


def _off(fn: Callable[[], None]) -> None:
    with checksums_off():
        fn()


def format_table(rows: list[dict], mb: float) -> str:
    """The rows as a fixed-width table."""
    lines = [
        f"checkpoint of {mb:.0f} MB, one process; medians (CPU s: all threads)",
        f"{'op':<6} {'configuration':<22} {'threads':>7} {'median s':>9} {'CPU s':>7} "
        f"{'MB/s':>8} {'vs no checksums':>16}",
    ]
    for r in sorted(rows, key=lambda r: (r["op"] != "save", r["op"], r["threads"], r["config"])):
        ratio = "" if r["vs_baseline"] is None else f"{r['vs_baseline']:.3f}x"
        lines.append(
            f"{r['op']:<6} {r['config']:<22} {r['threads']:>7} {r['median_s']:>9.3f} "
            f"{r['cpu_s']:>7.3f} {r['mb_s']:>8.0f} {ratio:>16}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m torch_sagemaker.bench checkpoint", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--mb", type=int, default=100, help="checkpoint size in MB (default 100)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats per configuration")
    parser.add_argument(
        "--threads",
        type=lambda s: [int(x) for x in comma_list()(s)],
        default=[1, 2],
        help="writer thread counts, comma-separated (default 1,2)",
    )
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = parser.parse_args(argv)
    if args.mb < 4 or args.repeats < 1 or min(args.threads) < 1:
        parser.error("--mb must be >= 4, --repeats and --threads >= 1")
    rows = run(args)
    print(format_table(rows, args.mb))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
