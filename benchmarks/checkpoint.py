"""Benchmark of checkpoint checksums: save and load with and without them, same run.

``python -m benchmarks checkpoint [--mb 100 --repeats 7 --threads 1,2]`` saves a
state dict of about ``--mb`` MB (float32 tensors of a few MB each, like a small model's
layers) in one process, and compares, for each writer thread count:

- DCP alone (``dcp.save`` / ``dcp.load`` into a directory: no staging, no marker),
- ``torch_sagemaker`` save/load at a location made with ``checkpoint_location(...,
  checksums=False)`` (the baseline: the commit protocol as it was before checksums, the
  marker holding sizes only, nothing checksummed on save or load),
- ``torch_sagemaker`` save/load as shipped (CRC-32 while writing, verified on load).

The configurations take turns within each repeat so that load from other processes
spreads evenly; the table reports medians and the ratio to the baseline. A last row gives
the raw ``zlib.crc32`` throughput on the same bytes in memory.

``--s3 local`` adds the same three configurations against S3 in the same run: a ``moto``
server started on 127.0.0.1 (``tools/moto_server.py``; pip install "moto[server]"), written
and read through ``s3torchconnector`` ("DCP alone" is then DCP with ``s3torchconnector``'s
writer and reader). ``--s3 s3://bucket/prefix`` uses a real bucket instead (endpoint, region
and credentials from the AWS variables). The local server keeps objects in memory and talks
HTTP over loopback, so its rows measure the client and protocol costs, not a network.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import comma_list


def make_state(mb: int) -> dict[str, torch.Tensor]:
    """About ``mb`` MB of float32 tensors of 4 MB each (seeded)."""
    torch.manual_seed(0)
    n = max(1, mb // 4)
    return {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(n)}


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (all threads of this process) of ``fn()``."""
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def _disk_cases(root: Path, state: dict, template: dict, threads: int) -> tuple[list, list]:
    """(save cases, load cases) of the local directory ``root``."""
    import torch.distributed.checkpoint as dcp

    from torch_sagemaker.checkpoint import checkpoint_location, load, save
    from torch_sagemaker.checkpoint.filesystem import DistributedFileSystemWriter

    def writer(threads: int = threads) -> DistributedFileSystemWriter:
        return DistributedFileSystemWriter("unused", thread_count=threads)

    plain = root / f"dcp{threads}"
    off, on = checkpoint_location(root / f"off{threads}", checksums=False), root / f"on{threads}"
    saves = [
        (
            "DCP alone",
            lambda: dcp.save(state, storage_writer=writer(), checkpoint_id=plain, no_dist=True),
        ),
        ("tsm, no checksums", lambda: save(state, checkpoint_id=off, storage_writer=writer())),
        ("tsm, crc32", lambda: save(state, checkpoint_id=on, storage_writer=writer())),
    ]
    loads = [
        ("DCP alone", lambda: dcp.load(template, checkpoint_id=plain, no_dist=True)),
        ("tsm, no checksums", lambda: load(template, checkpoint_id=off)),
        ("tsm, crc32", lambda: load(template, checkpoint_id=on)),
    ]
    return saves, loads


def check_markers(root: Path, threads: int) -> None:
    """Refuses a run whose baseline kept checksums, or whose checksummed save did not.

    Raises:
        RuntimeError: If a marker is not what its configuration promises.
    """
    from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER

    for name, checksummed in ((f"off{threads}", False), (f"on{threads}", True)):
        marker = json.loads((root / name / COMPLETION_MARKER).read_text())
        if ("checksums" in marker) != checksummed:
            raise RuntimeError(f"{name}: the marker does not match its configuration: {marker}")


def _s3_cases(root: str, state: dict, template: dict, threads: int) -> tuple[list, list]:
    """(save cases, load cases) of the S3 prefix ``root`` (``s3torchconnector`` throughout)."""
    import torch.distributed.checkpoint as dcp

    from torch_sagemaker.checkpoint import checkpoint_location, load, save
    from torch_sagemaker.checkpoint.s3_checkpoint import S3Checkpoint

    # DCP alone: s3torchconnector's writer and reader on a fixed prefix, no marker, no checks.
    plain = S3Checkpoint(f"{root}/dcp{threads}")
    plain_id = "0" * 32
    off = checkpoint_location(f"{root}/off{threads}", checksums=False)
    on = checkpoint_location(f"{root}/on{threads}")

    def tsm_save(location: Any) -> None:
        # A writer with the thread count; save() points it at the save's own prefix.
        writer = location.storage_writer(plain_id, threads)
        save(state, checkpoint_id=location, storage_writer=writer)

    saves = [
        (
            "DCP alone",
            lambda: dcp.save(
                state,
                storage_writer=plain.storage_writer(plain_id, threads),
                checkpoint_id=plain.data_uri(plain_id),
                no_dist=True,
            ),
        ),
        ("tsm, no checksums", lambda: tsm_save(off)),
        ("tsm, crc32", lambda: tsm_save(on)),
    ]
    loads = [
        (
            "DCP alone",
            lambda: dcp.load(
                template,
                storage_reader=plain.storage_reader({"data": plain_id}),
                checkpoint_id=plain.data_uri(plain_id),
                no_dist=True,
            ),
        ),
        ("tsm, no checksums", lambda: load(template, checkpoint_id=off)),
        ("tsm, crc32", lambda: load(template, checkpoint_id=on)),
    ]
    return saves, loads


@contextlib.contextmanager
def _s3_root(spec: str | None) -> Iterator[str | None]:
    """The S3 prefix the S3 rows use: none, a fresh bucket on a local moto server, or ``spec``."""
    if spec is None:
        yield None
        return
    if spec != "local":
        yield spec.rstrip("/") + f"/tsm-bench-{time.time_ns()}"
        return
    from tools.moto_server import environment, moto_s3

    with moto_s3() as server, environment(server.env):
        bucket = "tsm-bench"
        server.boto3().create_bucket(Bucket=bucket)
        yield f"s3://{bucket}/ckpt"


def run(args: argparse.Namespace) -> list[dict]:
    """Times every configuration; returns one row per (target, op, configuration, threads)."""
    state = make_state(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="tsm_bench_ckpt_", dir=args.dir))
    template = {k: torch.empty_like(v) for k, v in state.items()}
    times: dict[tuple[str, str, str, int], list[tuple[float, float]]] = {}
    try:
        with _s3_root(args.s3) as s3_root:
            targets: list[tuple[str, Callable[[int], tuple[list, list]]]] = [
                ("disk", lambda t: _disk_cases(root, state, template, t))
            ]
            if s3_root is not None:
                label = "s3 (moto)" if args.s3 == "local" else "s3"
                targets.append((label, lambda t: _s3_cases(s3_root, state, template, t)))
            for _ in range(args.repeats):
                for threads in args.threads:
                    for target, cases in targets:
                        saves, loads = cases(threads)
                        for name, fn in saves:
                            times.setdefault((target, "save", name, threads), []).append(_timed(fn))
                        for name, fn in loads:
                            times.setdefault((target, "load", name, threads), []).append(_timed(fn))
                        if not torch.equal(template["layer0.weight"], state["layer0.weight"]):
                            raise RuntimeError("the benchmark loaded other values than it saved")
                        for t in template.values():
                            t.zero_()  # the next load must really fill it
            for threads in args.threads:
                check_markers(root, threads)
        flat = torch.cat([v.flatten() for v in state.values()]).numpy().data.cast("B")
        crc = [_timed(lambda: zlib.crc32(flat)) for _ in range(args.repeats)]
        times[("memory", "crc32", "zlib.crc32", 1)] = crc
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for (target, op, name, threads), ts in times.items():
        base = times.get((target, op, "tsm, no checksums", threads))
        med = statistics.median(t for t, _ in ts)
        rows.append(
            {
                "target": target,
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


def format_table(rows: list[dict], mb: float) -> str:
    """The rows as a fixed-width table."""
    lines = [
        f"checkpoint of {mb:.0f} MB, one process; medians (CPU s: all threads)",
        f"{'target':<10} {'op':<6} {'configuration':<22} {'threads':>7} {'median s':>9} "
        f"{'CPU s':>7} {'MB/s':>8} {'vs no checksums':>16}",
    ]
    order = {"disk": 0, "memory": 2}
    for r in sorted(
        rows,
        key=lambda r: (
            r["op"] == "crc32",
            r["op"] != "save",
            order.get(r["target"], 1),
            r["threads"],
            r["config"],
        ),
    ):
        ratio = "" if r["vs_baseline"] is None else f"{r['vs_baseline']:.3f}x"
        lines.append(
            f"{r['target']:<10} {r['op']:<6} {r['config']:<22} {r['threads']:>7} "
            f"{r['median_s']:>9.3f} {r['cpu_s']:>7.3f} {r['mb_s']:>8.0f} {ratio:>16}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks checkpoint", description=__doc__.splitlines()[0]
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
    parser.add_argument(
        "--s3",
        default=None,
        help="also S3, in the same run: 'local' (a moto server on 127.0.0.1) or s3://bucket/prefix",
    )
    args = parser.parse_args(argv)
    if args.mb < 4 or args.repeats < 1 or min(args.threads) < 1:
        parser.error("--mb must be >= 4, --repeats and --threads >= 1")
    rows = run(args)
    print(format_table(rows, args.mb))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
