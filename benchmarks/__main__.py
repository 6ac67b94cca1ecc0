"""``python -m benchmarks <benchmark> [options]`` (``--help`` lists them)."""

from __future__ import annotations

import importlib
import sys

from benchmarks import BENCHMARKS


def _usage() -> str:
    lines = ["usage: python -m benchmarks <benchmark> [options]", "", "benchmarks:"]
    lines += [f"  {name:<12} {desc}" for name, (_mod, desc) in BENCHMARKS.items()]
    lines.append("\n`python -m benchmarks <benchmark> --help` shows its options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatches to the benchmark module named by the first argument."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = BENCHMARKS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        print(
            f"benchmark {name!r} is not available: module {module_name} is missing", file=sys.stderr
        )
        return 2
    result = module.main(rest)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
