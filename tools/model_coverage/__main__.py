"""``python -m tools.model_coverage``: TP parity over transformers' causal-LM families.

Writes docs/model_coverage.md (or ``--output``). The full sweep is long (every family on
4 CPU ranks); ``--families qwen3,llama`` runs some. See the generated page for the method.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from tools.model_coverage import launch, parity, report

DEFAULT_OUTPUT = "docs/model_coverage.md"


def _families(selected: str | None) -> list[tuple[str, str]]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    pairs = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())
    if selected is None:
        return pairs
    wanted = [f.strip() for f in selected.split(",") if f.strip()]
    known = dict(pairs)
    unknown = [f for f in wanted if f not in known]
    if unknown:
        raise SystemExit(
            f"--families: {unknown} are not in transformers' causal-LM registry "
            "(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES keys, e.g. qwen3, gemma2)."
        )
    return [(f, known[f]) for f in wanted]


def main(argv: list[str] | None = None) -> list[report.Row]:
    """Runs the sweep and writes the report; returns its rows."""
    parser = argparse.ArgumentParser(prog="python -m tools.model_coverage", description=__doc__)
    parser.add_argument("--families", help="comma-separated model types (default: every one)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="markdown file to write")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per family")
    parser.add_argument(
        "--fsdp",
        type=int,
        choices=(1, 2),
        default=2,
        help="FSDP2 (fully_shard, the default) or FSDP1 as SMP's example scripts wrap",
    )
    args = parser.parse_args(argv)

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    rows = [report.classify(f, c) for f, c in _families(args.families)]
    to_run = [r.family for r in rows if r.runs]
    outcomes = launch.run_families(
        to_run,
        world=4,
        config={"tensor_parallel_degree": parity.TP, "hybrid_shard_degree": parity.HYBRID_SHARD},
        timeout=args.timeout,
        log=lambda line: print(line, file=sys.stderr, flush=True),
        fsdp=args.fsdp,
    )
    for row in rows:
        if row.runs:
            report.settle(row, outcomes[row.family])
    command = (
        "python -m tools.model_coverage"
        + (f" --families {args.families}" if args.families else "")
        + (" --fsdp 1" if args.fsdp == 1 else "")
    )
    text = report.markdown(
        rows,
        command,
        {"transformers": transformers.__version__, "torch": torch.__version__},
        fsdp=args.fsdp,
    )
    with open(args.output, "w") as f:
        f.write(text)
    print(f"wrote {args.output}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
