"""``make gpu-check``: builds and runs every CUDA path of the package, and writes one report.

Run from the repository root with the Python that holds the machine's torch (on a GPU
machine without a virtual environment: ``python3 scripts/gpu_check.py``). The steps run in
order within ``--budget`` seconds; one that fails or times out does not stop the later ones,
and one that hangs does not take their time (Note [Step time limits]):

1. versions: Python, torch, CUDA, the GPU, transformers, accelerate, and ``nvidia-smi``;
2. build: the extension against this torch (``pip install -e`` the first time, then an
   incremental ``build_ext --inplace``), and ``import torch.sagemaker``;
3. the GPU tests, one step per file of tests/gpu (smddp on CUDA tensors, the offloader's CUDA
   path, FSDP1/FSDP2/TP parity on CUDA, the example script, Transformer Engine, FP8 layers);
4. ``bench gpu``: copy bandwidth, staged all_reduce (pinned, pool; float32 and bfloat16)
   against its stages' bounds (pipelined, serial), NCCL or the copy floor, kernels per staged
   all_reduce;
5. ``bench gpu --timeline``: where one call's time goes, per rank, with 2 ranks and with 1
   (Note [Staging timeline] in csrc/smddp/backend/device_staging.h);
6. ``bench fp8``: FP8 against bf16 matrix products and linear layers for the example model's
   shapes and a 4096-wide layer; the FP8 CPU tests (bit-exact emulation) on this machine's torch;
7. the CPU tests of the staging code (with ``bench gpu --device cpu``, its rehearsal through
   the staging seam) and of the backend choice, on this machine's torch.

Without CUDA every CUDA step is skipped with its reason (a rehearsal: it checks the script,
the build and the collection of the GPU tests). The report (``report.md``, ``report.json``)
and every step's output (``steps.log``) go to ``$OUT`` when it is set, else to
``--out`` (default ``outputs/gpu-check``). Exit status: 0 when no step failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
_clock = time.monotonic  # every time limit reads this clock (a test gives it a fake one)

# The GPU tests, one step per file: name, file, what it checks, cap in seconds.
GPU_TESTS = (
    (
        "smddp_cuda",
        "tests/gpu/test_smddp_cuda.py",
        "smddp on CUDA tensors (2 ranks), stream ordering, profiler, DDP/FSDP2, the staging "
        "timeline, pinned vs pool waits, out-only ordering, bf16",
        180,
    ),
    ("offload_cuda", "tests/gpu/test_offload_cuda.py", "offloader's CUDA path", 150),
    (
        "parallel_cuda",
        "tests/gpu/test_parallel_cuda.py",
        "FSDP1 (SMP's call) and FSDP2 bf16, TP over DTensor, against one process",
        240,
    ),
    ("example_cuda", "tests/gpu/test_example_cuda.py", "examples/train.py on 2 ranks", 180),
    ("te_cuda", "tests/gpu/test_te_backend.py", "Transformer Engine TP backend", 120),
    (
        "fp8_cuda",
        "tests/gpu/test_fp8_cuda.py",
        "FP8 linear layers on the device against the CPU emulation",
        150,
    ),
)
BENCH_GPU = ["-m", "benchmarks", "gpu"]
# bench gpu --timeline, float32: 2 ranks sharing the GPU without the table, then 1 alone
# with a short table (its stages and bounds without a peer).
TIMELINE_ARGS = ["--timeline", "--dtypes", "float32", "--iters", "10"]
TIMELINE_RUNS = (
    ["--nprocs", "2", "--no-table", "--timeline-sizes", "64K,16M"],
    ["--nprocs", "1", "--sizes", "64K,1M,16M", "--timeline-sizes", "64K"],
)
BENCH_FP8 = ["-m", "benchmarks", "fp8", "--iters", "20"]
CPU_STAGING_TESTS = [
    "tests/distributed/test_smddp_staging.py",
    "tests/distributed/test_smddp_staging_timeline.py",
    "tests/distributed/test_bench_gpu.py",
    "tests/unit/test_gpu_bench_report.py",
    "tests/unit/test_gpu_backend_choice.py",
    "tests/unit/test_extension_build.py",
]

VERSIONS = r"""
import platform, torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", torch.cuda.device_count(), "x", p.name, f"{p.total_memory / 2**30:.0f} GiB",
          f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs")
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
for name in ("transformers", "accelerate", "safetensors", "transformer_engine"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as e:
        print(name, "missing:", type(e).__name__)
"""

PIP_EDITABLE = [
    PY,
    "-m",
    "pip",
    "install",
    "--no-deps",
    "--no-build-isolation",
    "--no-index",
    "-e",
    ".",
]
PRIVATE_LIBSTDCXX = "its own copy of libstdc++"  # setup.py's error (Note [One libstdc++])

# How this interpreter links extensions (Note [One libstdc++] in setup.py).
BUILD_ENV = r"""
import os, sysconfig
for key in ("CC", "CXX", "LDSHARED", "LDCXXSHARED", "LDFLAGS", "CFLAGS", "CXXFLAGS"):
    print(f"{key}: env={os.environ.get(key)!r} sysconfig={sysconfig.get_config_var(key)!r}")
"""

IMPORTS = r"""
import torch.sagemaker as tsm
import torch_sagemaker._C
from torch_sagemaker.smddp import backend
assert backend.is_available(), "smddp extension not registered"
print("torch.sagemaker", tsm.__version__, "from", tsm.__file__)
"""


@dataclass
class Step:
    """One step of the check and what came of it."""

    name: str
    what: str
    status: str = "not run"  # passed, failed, skipped, timed out
    seconds: float = 0.0
    detail: str = ""
    tests: dict[str, str] = field(default_factory=dict)  # test id -> outcome


def _run(cmd: list[str], timeout: float, log, env: dict[str, str] | None = None):
    """Runs ``cmd`` from the repository root; its output goes to ``log``. Returns (rc, output)."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    try:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = _text(e.stdout) + _text(e.stderr) + f"\n[timed out after {timeout:.0f} s]\n"
        rc = None
    log.write(out + "\n")
    log.flush()
    return rc, out


def _text(b) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def _alias_without_install(work: Path) -> None:
    """Makes the package and ``import torch.sagemaker`` work in later steps without pip.

    The later steps' Pythons find the checkout on ``PYTHONPATH`` and run a ``sitecustomize``
    that imports the alias finder, which the installed ``torch_sagemaker.pth`` does otherwise.
    """
    site = work / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text("import _torch_sagemaker_alias  # noqa: F401\n")
    paths = [str(ROOT), str(site), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)


def _use_carried_wheels(work: Path) -> None:
    """Installs the wheels of ``.whl/`` (scripts/fetch_gpu_wheels.sh) for the later steps."""
    wheels = sorted(str(w) for w in (ROOT / ".whl").glob("*.whl"))
    if not wheels:
        return
    target = work / "wheels"
    subprocess.run(
        [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade"]
        + ["--target", str(target), *wheels],
        check=True,
    )
    paths = [str(target), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)


def _cuda() -> tuple[bool, str]:
    import torch

    if torch.cuda.is_available():
        return True, ""
    return False, f"no CUDA here (torch {torch.__version__}, torch.cuda.is_available() is False)"


def _junit_outcomes(path: Path) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped: <reason>, from pytest's JUnit XML."""
    if not path.exists():
        return {}
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag
            elif child.tag == "skipped":
                outcome = "skipped: " + (child.get("message") or "")
        outcomes[test_id] = outcome
    return outcomes


def _pytest_step(step: Step, paths: list[str], timeout: float, log, work: Path) -> None:
    """Runs pytest on ``paths`` and records the outcome of each test."""
    xml = work / f"{step.name}.xml"
    xml.unlink(missing_ok=True)  # a run killed before writing it must not read an older one
    rc, out = _run(
        [PY, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}", *paths],
        timeout,
        log,
    )
    step.tests = _junit_outcomes(xml)
    summary = [
        ln for ln in out.splitlines() if re.match(r"^=+ .*(passed|failed|skipped|error)", ln)
    ]
    tail = out.strip().splitlines()
    step.detail = summary[-1].strip("= ") if summary else (tail[-1] if tail else "")
    if rc is None:
        step.status = "timed out"
    elif rc == 0 and step.tests and all(v.startswith("skipped") for v in step.tests.values()):
        step.status = "skipped"
    elif rc == 0:
        step.status = "passed"
    else:
        step.status = "failed"


# Note [Step time limits]
# The check must fit one command of the device tool (600 s) with its report, so it runs
# within --budget (570 s). Each step has a cap (the most it may take) and a floor (the least
# worth running it with). A step's limit is its cap, cut so that the steps after it that will
# run keep their floors, but never below its own floor; with less than its floor left it is
# skipped. So a step that hangs until its limit cannot take the later steps' time: each later
# step still runs, with at least its floor. The build reserves nothing: no later step can run
# without it. A step's commands share its limit (``limit`` cuts each to what is left of it).
# tests/unit/test_gpu_check.py checks this with a fake clock.


@dataclass
class Plan:
    """A step to run and its time (Note [Step time limits]).

    ``body(step, limit)`` fills ``step``; ``limit(s)`` cuts ``s`` seconds to what is left of
    the step's time (all of it without ``s``).
    """

    name: str
    what: str
    body: Callable[[Step, Callable[[float], float]], None]
    cap: float
    floor: float = 20
    needs_cuda: bool = False
    needs_build: bool = True


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "outputs" / "gpu-check"))
    p.add_argument("--work", default=str(ROOT / "build" / "gpu-check"), help=argparse.SUPPRESS)
    p.add_argument("--bench-sizes", default="64K,1M,4M,16M,64M")
    p.add_argument("--skip", default="", help="comma-separated step names to leave out")
    p.add_argument(
        "--budget",
        type=float,
        default=570,
        help="seconds for the whole check (the device tool allows 600 s a command): each "
        "step's limit is cut so that the later steps keep their floors (Note [Step time limits])",
    )
    return p.parse_args(argv)


def _plans(args: argparse.Namespace, log, work: Path) -> list[Plan]:
    """Every step of the check, in order (the module's docstring says what each one is)."""

    def versions(s: Step, limit) -> None:
        rc, text = _run([PY, "-c", VERSIONS], limit(120), log)
        _, flags = _run([PY, "-c", BUILD_ENV], limit(60), log)
        text += flags
        _, shm = _run(["df", "-h", "/dev/shm"], limit(30), log)  # smddp's segments
        text += shm
        if shutil.which("nvidia-smi"):
            _, smi = _run(["nvidia-smi"], limit(60), log)
            text += smi
        else:
            text += "nvidia-smi: not on PATH\n"
        s.status = "passed" if rc == 0 else "failed"
        s.detail = text.strip()

    def build(s: Step, limit) -> None:
        notes = []
        rc, _ = _run([PY, "-c", IMPORTS], limit(300), log)
        if rc != 0:  # not installed yet: one editable install compiles and adds the alias
            rc, text = _run(PIP_EDITABLE, limit(900), log)
            if rc != 0 and PRIVATE_LIBSTDCXX in text and "CXX" in os.environ:
                # Note [One libstdc++] in setup.py: this machine's CXX links its own
                # libstdc++; the interpreter's default compiler is the one torch matches.
                notes.append(f"CXX={os.environ['CXX']} links a private libstdc++; used the default")
                for key in ("CC", "CXX"):
                    os.environ.pop(key, None)
                rc, text = _run(PIP_EDITABLE, limit(900), log)
            if rc != 0:  # a read-only environment: build in place, alias by sitecustomize
                _alias_without_install(work)
                notes.append("pip install -e failed; built in place with PYTHONPATH")
        # Incremental: recompiles only what csrc/ changed since the last build.
        rc, text = _run([PY, "setup.py", "-q", "build_ext", "--inplace"], limit(900), log)
        if rc != 0:
            s.status, s.detail = "failed", "build_ext failed:\n" + text[-3000:]
            return
        rc, text = _run([PY, "-c", IMPORTS], limit(300), log)
        s.status = "passed" if rc == 0 else "failed"
        last = text.strip().splitlines()[-1] if text.strip() else ""
        s.detail = "; ".join([last, *notes])

    def tests(paths: list[str]):
        return lambda s, limit: _pytest_step(s, paths, limit(), log, work)

    def command(argv: list[str], keep: int):
        def body(s: Step, limit) -> None:
            rc, text = _run([PY, *argv], limit(), log)
            s.status = "passed" if rc == 0 else ("timed out" if rc is None else "failed")
            s.detail = text.strip()[-keep:]

        return body

    def timeline(s: Step, limit) -> None:
        # 2 ranks sharing the GPU, then 1 alone (no peer to wait for, no second process on
        # the GPU): what differs is what sharing costs (docs/gpu.md, the hypotheses).
        texts, rcs = [], []
        for extra in TIMELINE_RUNS:
            if limit() < 10:  # the step's time is spent (Note [Step time limits])
                texts.append(f"$ bench gpu {' '.join(extra)}: not run, out of time")
                break
            rc, text = _run([PY, *BENCH_GPU, *TIMELINE_ARGS, *extra], limit(150), log)
            rcs.append(rc)
            texts.append(f"$ bench gpu {' '.join(extra)}: rc {rc}\n{text.strip()}")
        failed = "timed out" if None in rcs else "failed"
        s.status = "passed" if all(rc == 0 for rc in rcs) else failed
        s.detail = "\n\n".join(texts)[-12000:]

    plans = [
        Plan("versions", "versions and nvidia-smi", versions, 120, needs_build=False),
        Plan(
            "build",
            "the extension against this torch; import torch.sagemaker",
            build,
            900,
            needs_build=False,
        ),
    ]
    plans += [Plan(name, what, tests([path]), cap) for name, path, what, cap in GPU_TESTS]
    bench_sizes = ["--sizes", args.bench_sizes, "--iters", "20"]
    plans += [
        Plan(
            "bench_gpu",
            "bench gpu: bandwidth, staged all_reduce (float32, bfloat16) against its bounds, "
            "kernels",
            command([*BENCH_GPU, "--nprocs", "2", *bench_sizes], 12000),
            240,
            floor=60,
            needs_cuda=True,
        ),
        Plan(
            "gpu_timeline",
            "bench gpu --timeline: one call's phases, 2 ranks and 1",
            timeline,
            200,
            floor=60,
            needs_cuda=True,
        ),
        Plan(
            "bench_fp8",
            "bench fp8: FP8 vs bf16 matmul and linear time, example model and 4096-wide layer",
            command(BENCH_FP8, 6000),
            180,
            floor=30,
            needs_cuda=True,
        ),
        Plan(
            "fp8_cpu",
            "the FP8 CPU tests (bit-exact emulation) on this machine's torch",
            tests(["tests/unit/test_fp8_numerics.py"]),
            120,
            # The GPU machine's torch is the point; here the suite runs them.
            needs_cuda=True,
        ),
        Plan(
            "cpu_staging",
            "CPU tests of the staging code and the backend choice, on this torch",
            tests(CPU_STAGING_TESTS),
            300,
            floor=30,
        ),
    ]
    return plans


def main(argv: list[str] | None = None) -> int:
    """Runs the steps and writes the report; returns 1 if any step failed or timed out."""
    args = _parse(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    skip = {s for s in args.skip.split(",") if s}
    _use_carried_wheels(work)
    has_cuda, no_cuda = _cuda()
    started = _clock()
    steps: list[Step] = []
    built = True

    def why_not(plan: Plan) -> str:
        """Why ``plan`` will not run ("" while it may), before time is counted."""
        if plan.name in skip:
            return "left out with --skip"
        if plan.needs_cuda and not has_cuda:
            return no_cuda
        if plan.needs_build and not built:
            return "the build step failed"
        return ""

    with open(out / "steps.log", "w") as log:
        plans = _plans(args, log, work)
        for i, plan in enumerate(plans):
            s = Step(plan.name, plan.what)
            steps.append(s)
            log.write(f"\n===== {plan.name}: {plan.what}\n")
            left = args.budget - (_clock() - started)
            reserve = 0.0
            if plan.name != "build":  # Note [Step time limits]
                reserve = sum(p.floor for p in plans[i + 1 :] if not why_not(p))
            seconds = max(plan.floor, min(plan.cap, left - reserve))
            if why_not(plan):
                s.status, s.detail = "skipped", why_not(plan)
            elif left < plan.floor:
                s.status, s.detail = "skipped", f"out of time (--budget {args.budget:.0f} s)"
            else:
                _run_step(plan, s, min(seconds, left))
                first = s.detail.splitlines()[0] if s.detail else ""
                print(f"[gpu-check] {s.name}: {s.status} ({s.seconds:.0f} s) {first}", flush=True)
            if plan.name == "build":
                built = s.status == "passed"
            # Written after every step: a check killed at its limit still leaves a report.
            _write_report(out, steps, _clock() - started, has_cuda)
    total = _clock() - started
    _write_report(out, steps, total, has_cuda)
    bad = [s.name for s in steps if s.status in ("failed", "timed out")]
    print(f"[gpu-check] {len(steps)} steps in {total:.0f} s; failed: {bad or 'none'}; report {out}")
    return 1 if bad else 0


def _run_step(plan: Plan, s: Step, seconds: float) -> None:
    """Runs ``plan``'s body into ``s`` within ``seconds``; an exception fails the step only."""
    t0 = _clock()
    deadline = t0 + seconds

    def limit(want: float = math.inf) -> float:
        return max(1.0, min(want, deadline - _clock()))

    try:
        plan.body(s, limit)
    except Exception as e:  # a broken step must not stop the others
        s.status, s.detail = "failed", f"{type(e).__name__}: {e}"
    s.seconds = _clock() - t0


def _write_report(out: Path, steps: list[Step], total: float, has_cuda: bool) -> None:
    lines = [
        "# gpu-check report",
        "",
        f"{'GPU run' if has_cuda else 'CPU rehearsal (no CUDA)'}, {total:.0f} s in all.",
        "",
        "| step | what | status | seconds | detail |",
        "|---|---|---|---|---|",
    ]
    for s in steps:
        first = s.detail.splitlines()[0] if s.detail else ""
        lines.append(f"| {s.name} | {s.what} | {s.status} | {s.seconds:.0f} | {first} |")
    for s in steps:
        if s.tests:
            lines += ["", f"## {s.name}", ""]
            lines += [f"- {outcome}: `{test}`" for test, outcome in s.tests.items()]
    for name in ("versions", "bench_gpu", "gpu_timeline", "bench_fp8"):
        s = next((x for x in steps if x.name == name), None)
        if s and s.detail:
            lines += ["", f"## {name}", "", "```", s.detail, "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "report.json").write_text(json.dumps([asdict(s) for s in steps], indent=1))


if __name__ == "__main__":
    sys.exit(main())
