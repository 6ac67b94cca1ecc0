"""``python -m torch_sagemaker.planner``: plan from the command line.

    python -m torch_sagemaker.planner CONFIG.json --seq-len 4096 --global-batch-tokens 4M
        --hosts 32 --instance p5.48xlarge [--limit tensor_parallel_degree=1,2,4,8]
        [--json plan.json] [--write-config best_smp.json] [--plot memory.png]

``python -m benchmarks planner ...``, from a checkout, measures the planner against this
machine (``benchmarks/planner/``; the benchmarks are not installed with the library).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from torch_sagemaker.planner import report
from torch_sagemaker.planner.inputs import SETTINGS, Limits
from torch_sagemaker.planner.presets import (
    ACCELERATORS,
    INSTANCES,
    Accelerator,
    accelerator,
    instance,
)
from torch_sagemaker.planner.search import DEFAULT_EFFICIENCY, plan

_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_count(text: str) -> int:
    """``4096``, ``4M``, ``2Mi``, ``512k``, ``4.1M`` -> an integer (decimal or binary suffixes).

    The number is read exactly (``Decimal``), so ``4.1M`` is 4,100,000, not a float's
    4,099,999.

    Raises:
        argparse.ArgumentTypeError: For text that is not a number, or a count that is not whole
            (``1.0001k``).
    """
    t = text.strip().lower()
    scale = 1
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], _UNITS[suffix]
            break
    try:
        number = Decimal(t)
    except InvalidOperation:
        number = Decimal("nan")
    if not number.is_finite():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count; write e.g. 4096, 4M (4e6) or 4Mi (4 x 2^20)"
        )
    if number and number.adjusted() > 18:  # before any arithmetic on a huge exponent
        raise argparse.ArgumentTypeError(f"{text!r} is too large a count; give one below 1e19.")
    value = Fraction(number) * scale  # exact: Decimal's own arithmetic rounds to 28 digits
    if value.denominator != 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {float(value):.10g}, not a whole count; give a whole number "
            "(e.g. 4096, 4M, 4Mi)"
        )
    return int(value)


def parse_rate(text: str) -> float:
    """``100gbit``, ``400Gbps``, ``1e11`` -> bits per second."""
    t = text.strip().lower().removesuffix("ps").removesuffix("bit").removesuffix("b")
    mult = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if mult != 1.0 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a rate; write e.g. 100gbit or 1e11 (bits/s)"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a rate must be positive")
    return value


def parse_limit(text: str) -> tuple[str, tuple]:
    """``name=v1,v2`` -> (name, values); booleans as true/false, FSDP versions as 1/2."""
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or name not in SETTINGS:
        raise argparse.ArgumentTypeError(
            f"--limit {text!r}: write SETTING=V1,V2 with SETTING one of {', '.join(SETTINGS)}"
        )
    parsed: list[object] = []
    for v in values.split(","):
        v = v.strip().lower()
        if v in ("true", "false", "on", "off"):
            parsed.append(v in ("true", "on"))
        else:
            try:
                parsed.append(int(v))
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"--limit {text!r}: {v!r} is neither an integer nor true/false"
                ) from None
    return name, tuple(parsed)


def _positive_option(option: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{option} {value!r}: must be a positive, finite number.")


def _accelerator(args: argparse.Namespace) -> Accelerator | str | None:
    """The accelerator the options describe: a preset name, or one with your own numbers.

    ``--memory-gib`` and ``--bf16-tflops`` replace those figures of a base accelerator (the
    ``--accelerator`` preset, else the ``--instance``'s, else H100), which gives everything
    not given: memory bandwidth, NVLink and PCIe rates, and the other figure.

    Raises:
        ValueError: For a figure that is not positive and finite, or an unknown preset.
    """
    if args.memory_gib is None and args.bf16_tflops is None:
        return args.accelerator
    if args.accelerator:
        base = accelerator(args.accelerator)
    elif args.instance:
        base = accelerator(instance(args.instance).accelerator)
    else:
        base = accelerator("H100")
    memory_bytes, bf16, fp32 = base.memory_bytes, base.bf16_flops, base.fp32_flops
    if args.memory_gib is not None:
        _positive_option("--memory-gib", args.memory_gib)
        memory_bytes = int(args.memory_gib * 2**30)
    if args.bf16_tflops is not None:
        _positive_option("--bf16-tflops", args.bf16_tflops)
        bf16 = args.bf16_tflops * 1e12
        fp32 = bf16 / 2  # half the bf16 rate, as every preset has it
    return Accelerator(
        name=f"custom ({base.name}-based)",
        memory_bytes=memory_bytes,
        bf16_flops=bf16,
        fp32_flops=fp32,
        memory_bandwidth=base.memory_bandwidth,
        link_rate=base.link_rate,
        host_rate=base.host_rate,
    )


def build_parser() -> argparse.ArgumentParser:
    """The plan command's arguments."""
    p = argparse.ArgumentParser(
        prog="python -m torch_sagemaker.planner",
        description="Rank SMP configurations for a model on a cluster by predicted step time, "
        "with each rank's predicted memory (docs/planner.md). "
        "'python -m benchmarks planner --help' for the validation.",
    )
    p.add_argument("config", help="a Hugging Face config.json (or its directory), read locally")
    p.add_argument("--seq-len", type=parse_count, required=True)
    p.add_argument(
        "--global-batch-tokens", type=parse_count, required=True, help="tokens per step, all ranks"
    )
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--instance", choices=sorted(INSTANCES), help="a host preset")
    p.add_argument("--accelerator", help=f"a preset: {', '.join(ACCELERATORS)} (default H100)")
    p.add_argument(
        "--memory-gib",
        type=float,
        help="your accelerator's memory, GiB (the rest from --accelerator, the instance's or H100)",
    )
    p.add_argument(
        "--bf16-tflops",
        type=float,
        help="your accelerator's dense bf16 TFLOP/s (the rest as for --memory-gib)",
    )
    p.add_argument(
        "--per-host", type=int, help="accelerators per host (default: the instance's, else 8)"
    )
    p.add_argument("--nics", type=int, help="NICs per host (default: the instance's, else 1)")
    p.add_argument(
        "--nic-rate",
        type=parse_rate,
        help="each NIC's rate, e.g. 100gbit (default: the instance's, else 100gbit)",
    )
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument(
        "--limit",
        type=parse_limit,
        action="append",
        default=[],
        metavar="SETTING=V1,V2",
        help=f"values to try for a setting ({', '.join(SETTINGS)}); repeatable",
    )
    p.add_argument(
        "--max-horizon",
        type=int,
        default=4,
        help="largest loading horizon tried (1 to it) unless --limit "
        "activation_loading_horizon=... names the horizons: then exactly those",
    )
    p.add_argument(
        "--efficiency",
        type=float,
        default=DEFAULT_EFFICIENCY,
        help="fraction of peak FLOP/s the compute reaches",
    )
    p.add_argument("--usable-memory", type=float, default=0.9, help="fraction of device memory")
    p.add_argument("--top", type=int, default=10, help="rows of the table (0: none)")
    p.add_argument("--json", help="write the plan as JSON here ('-' for stdout, no table)")
    p.add_argument("--write-config", help="write the best configuration's SMP JSON here")
    p.add_argument("--plot", help="draw the top configurations' memory to this PNG")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the planner and prints the result; returns the exit status (2 for ``validate``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["validate"]:
        print(
            "planner: 'validate' is a benchmark now, run from a source checkout: "
            f"python -m benchmarks planner {' '.join(argv[1:]) or '--help'}",
            file=sys.stderr,
        )
        return 2
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, TypeError) as e:  # bad input: the message names it and the fix
        print(f"planner: {e}", file=sys.stderr)
        return 2


def _check_output(option: str, path: str | None) -> None:
    """Refuses an output path that cannot be written, before the search spends its time.

    Raises:
        ValueError: ``cannot write ...``, naming the option, the path and the fix.
    """
    if path is None or (option == "--json" and path == "-"):
        return
    if os.path.isdir(path):
        raise ValueError(f"cannot write {option} {path!r}: it is a directory; give a file name.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(
            f"cannot write {option} {path!r}: the directory {folder!r} does not exist; "
            "create it or choose another path."
        )
    if not os.access(folder, os.W_OK):
        raise ValueError(
            f"cannot write {option} {path!r}: the directory {folder!r} is not writable; "
            "choose another path."
        )


def _write(option: str, path: str, write: Callable[[str], None]) -> None:
    """Runs ``write(path)``; an OS error is the one-line ``cannot write ...`` (exit 2)."""
    try:
        write(path)
    except OSError as e:
        raise ValueError(f"cannot write {option} {path!r}: {e.strerror or e}.") from None


def _run(args: argparse.Namespace) -> int:
    if args.top < 0:
        raise ValueError(f"--top {args.top}: rows of the table, 0 or more.")
    for option, path in (
        ("--json", args.json),
        ("--write-config", args.write_config),
        ("--plot", args.plot),
    ):
        _check_output(option, path)
    limits = Limits(allowed=dict(args.limit), max_horizon=args.max_horizon)
    result = plan(
        args.config,
        seq_len=args.seq_len,
        global_batch_tokens=args.global_batch_tokens,
        hosts=args.hosts,
        accelerator_name=_accelerator(args),
        per_host=args.per_host,
        instance_type=args.instance,
        nics=args.nics,
        nic_bits=args.nic_rate,
        dtype=args.dtype,
        limits=limits,
        efficiency=args.efficiency,
        usable_memory=args.usable_memory,
    )
    # With the JSON on stdout, stdout carries nothing else: the notices go to stderr.
    notices = sys.stderr if args.json == "-" else sys.stdout
    if args.json:
        text = json.dumps(report.to_json(result), indent=1)
        if args.json == "-":
            print(text)
        else:

            def write_json(path: str) -> None:
                with open(path, "w") as f:
                    f.write(text + "\n")

            _write("--json", args.json, write_json)
    if args.json != "-":
        print(report.describe_inputs(result))
        print(
            f"\n{len(result.ranked)} valid configurations, {len(result.fitting)} fit; "
            f"top {args.top}:"
        )
        print(report.table(result, args.top))
        print()
        print(report.rejected_summary(result))
    best = result.best
    if args.write_config:
        if best is None:
            print("no configuration fits; nothing written", file=sys.stderr)
            return 1
        _write(
            "--write-config", args.write_config, lambda path: report.write_smp_config(best, path)
        )
        print(
            f"\nwrote {args.write_config}: {json.dumps(best.candidate.smp_config())} "
            f"(script: {json.dumps(best.candidate.script())})",
            file=notices,
        )
    if args.plot:
        _write("--plot", args.plot, lambda path: report.plot(result, path))
        print(f"wrote {args.plot}", file=notices)
    return 0 if best is not None else 1


__all__ = ["build_parser", "main", "parse_count", "parse_limit", "parse_rate"]
