"""``make gpu-check`` (scripts/gpu_check.py) run through a fake runner and a fake clock.

The check is what a session with a GPU runs first, in minutes it cannot spend on the script
itself. Its plumbing is checked here without running its commands: which steps run, in which
order and with which commands (each file of tests/gpu has a step; each benchmark command line
parses with the benchmark's own parser), that a step that fails, raises or times out does not
stop the later ones, the report, and the time limits (Note [Step time limits]). The commands
themselves are covered elsewhere in the suite on this machine: the build by ``make build``,
tests/gpu (collected, skipped without CUDA) and the staging tests by ``make test``, and
``bench gpu`` by its CPU rehearsal (tests/distributed/test_bench_gpu.py). The runner's own
subprocess handling (output, timeout) and the reading of pytest's JUnit XML are run for real.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CUDA_STEPS = ["bench_gpu", "gpu_timeline", "bench_fp8", "fp8_cpu"]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class Machine:
    """A fake runner and clock: a command takes ``seconds`` of the fake clock, or its whole
    timeout (then it times out) when it runs longer; ``behave(cmd)`` may say otherwise.

    pytest commands write a JUnit file as pytest would: one test per path, skipped for want
    of CUDA in tests/gpu on a machine without, passed elsewhere (``fail`` names paths whose
    test fails).
    """

    def __init__(self, check, monkeypatch, cuda: bool, behave=None, fail=()):
        self.now = 0.0
        self.calls: list[tuple[list[str], float]] = []
        self.behave = behave or (lambda cmd: None)
        self.fail = set(fail)
        self.cuda = cuda
        monkeypatch.setattr(check, "_clock", lambda: self.now)
        monkeypatch.setattr(check, "_run", self.run)
        monkeypatch.setattr(check, "_use_carried_wheels", lambda work: None)
        reason = "" if cuda else "no CUDA here (a fake machine)"
        monkeypatch.setattr(check, "_cuda", lambda: (cuda, reason))

    def run(self, cmd, timeout, log, env=None):
        self.calls.append((cmd, timeout))
        rc, seconds, out = self.behave(cmd) or (0, 1.0, "ok\n")
        if seconds > timeout:
            self.now += timeout
            return None, out + f"[timed out after {timeout:.0f} s]\n"
        self.now += seconds
        xml = next((a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml=")), None)
        if xml:
            rc = self._junit(Path(xml), [a for a in cmd if a.startswith("tests/")]) or rc
            out += "==== 1 passed in 1.00s ====\n"
        return rc, out

    def _junit(self, xml: Path, paths: list[str]) -> int:
        cases = []
        for path in paths:
            name = path.removesuffix(".py").replace("/", ".")
            if path in self.fail:
                inner = '<failure message="assert False"/>'
            elif path.startswith("tests/gpu/") and not self.cuda:
                inner = '<skipped type="pytest.skip" message="CUDA is not available"/>'
            else:
                inner = ""
            cases.append(f'<testcase classname="{name}" name="test_one">{inner}</testcase>')
        xml.write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
        return 1 if self.fail & set(paths) else 0

    def commands(self, marker: str) -> list[tuple[list[str], float]]:
        return [(c, t) for c, t in self.calls if marker in c]


def _main(check, tmp_path, *extra: str) -> tuple[int, dict]:
    rc = check.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *extra])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    return rc, {s["name"]: s for s in report}


def _names(check) -> list[str]:
    return ["versions", "build", *(name for name, *_ in check.GPU_TESTS), *CUDA_STEPS] + [
        "cpu_staging"
    ]


def test_rehearsal_without_cuda_runs_every_step_and_writes_the_report(monkeypatch, tmp_path):
    check = _script()
    machine = Machine(check, monkeypatch, cuda=False)
    rc, steps = _main(check, tmp_path)
    assert rc == 0
    assert list(steps) == _names(check)
    # Every file of tests/gpu has a step of its own (the FP8 one among them).
    gpu_files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert {path for _, path, *_ in check.GPU_TESTS} == gpu_files
    assert "tests/gpu/test_fp8_cuda.py" in gpu_files
    assert steps["versions"]["status"] == steps["build"]["status"] == "passed"
    for name, path, *_ in check.GPU_TESTS:
        # Run without CUDA too: collecting them checks that they import; all skipped.
        assert steps[name]["status"] == "skipped", steps[name]
        assert list(steps[name]["tests"].values()) == ["skipped: CUDA is not available"]
        assert len(machine.commands(path)) == 1
    for name in CUDA_STEPS:
        assert steps[name]["status"] == "skipped", steps[name]
        assert steps[name]["detail"] == "no CUDA here (a fake machine)"
    assert not machine.commands("torch_sagemaker.bench")
    staging = steps["cpu_staging"]
    assert staging["status"] == "passed" and len(staging["tests"]) == len(check.CPU_STAGING_TESTS)
    # Every path a pytest command names exists.
    for cmd, _ in machine.commands("pytest"):
        for arg in cmd:
            if arg.startswith("tests/"):
                assert (ROOT / arg).is_file(), arg
    report = (tmp_path / "out" / "report.md").read_text()
    assert "CPU rehearsal (no CUDA)" in report
    assert "| cpu_staging | CPU tests of the staging code" in report
    assert "- skipped: CUDA is not available: `tests.gpu.test_fp8_cuda::test_one`" in report
    assert (tmp_path / "out" / "steps.log").read_text().count("\n===== ") == len(steps)


def test_with_cuda_every_benchmark_command_parses(monkeypatch, tmp_path):
    from torch_sagemaker.bench import fp8, gpu

    check = _script()
    machine = Machine(check, monkeypatch, cuda=True)
    rc, steps = _main(check, tmp_path, "--skip", "te_cuda")
    assert rc == 0
    assert steps["te_cuda"]["status"] == "skipped"
    assert steps["te_cuda"]["detail"] == "left out with --skip"
    assert all(s["status"] == "passed" for n, s in steps.items() if n != "te_cuda"), steps
    benches = machine.commands("torch_sagemaker.bench")
    parsers = {"gpu": gpu._parse, "fp8": fp8._parse}
    for cmd, _ in benches:
        name = cmd[cmd.index("torch_sagemaker.bench") + 1]
        parsers[name](cmd[cmd.index(name) + 1 :])  # exits on a bad option
    runs = [gpu._parse(c[c.index("gpu") + 1 :]) for c, _ in benches if "gpu" in c]
    table, *timelines = runs
    assert not table.timeline and table.nprocs == 2 and table.device == "cuda"
    assert table.dtypes == ["float32", "bfloat16"]  # item 4: the bf16 row
    assert [(r.nprocs, r.timeline) for r in timelines] == [(2, True), (1, True)]
    assert [c for c, _ in benches if "fp8" in c]
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.startswith("# gpu-check report\n\nGPU run")
    for name in ("versions", "bench_gpu", "gpu_timeline", "bench_fp8"):
        assert f"\n## {name}\n" in report
    assert machine.now <= 570


def test_a_failing_step_does_not_stop_the_later_ones(monkeypatch, tmp_path):
    check = _script()

    def behave(cmd):
        if "gpu" in cmd and "--timeline" not in cmd:
            raise RuntimeError("the runner broke")
        if "--timeline" in cmd and cmd[cmd.index("--nprocs") + 1] == "2":
            return 0, math.inf, "hung\n"  # runs into its limit
        return None

    machine = Machine(
        check, monkeypatch, cuda=True, behave=behave, fail={"tests/gpu/test_smddp_cuda.py"}
    )
    rc, steps = _main(check, tmp_path)
    assert rc == 1
    assert steps["smddp_cuda"]["status"] == "failed"
    assert list(steps["smddp_cuda"]["tests"].values()) == ["failure"]
    assert steps["bench_gpu"]["status"] == "failed"
    assert steps["bench_gpu"]["detail"] == "RuntimeError: the runner broke"
    assert steps["gpu_timeline"]["status"] == "timed out"
    assert "[timed out after" in steps["gpu_timeline"]["detail"]
    assert len(machine.commands("--timeline")) == 2  # the second run still ran
    after = ["offload_cuda", "parallel_cuda", "example_cuda", "te_cuda", "fp8_cuda"]
    for name in (*after, "bench_fp8", "fp8_cpu", "cpu_staging"):
        assert steps[name]["status"] == "passed", steps[name]
    out = (tmp_path / "out" / "report.md").read_text()
    assert "| bench_gpu | " in out and "| failed |" in out and "| timed out |" in out


def test_a_failed_build_skips_what_needs_it(monkeypatch, tmp_path):
    check = _script()
    monkeypatch.setenv("PYTHONPATH", "")  # the fallback build adds the checkout to it

    def behave(cmd):
        if "build_ext" in cmd:
            return 1, 1.0, "error: no compiler\n"
        if check.IMPORTS in cmd:
            return 1, 1.0, "ModuleNotFoundError\n"
        return None

    Machine(check, monkeypatch, cuda=True, behave=behave)
    rc, steps = _main(check, tmp_path)
    assert rc == 1
    assert steps["versions"]["status"] == "passed"
    assert steps["build"]["status"] == "failed"
    assert steps["build"]["detail"].startswith("build_ext failed:\nerror: no compiler")
    for name in _names(check)[2:]:
        assert steps[name]["status"] == "skipped", steps[name]
        assert steps[name]["detail"] == "the build step failed"


def test_time_limits_leave_the_later_steps_their_floors(monkeypatch, tmp_path):
    check = _script()
    hang = {"tests/gpu/test_parallel_cuda.py"}

    def behave(cmd):
        if hang & set(cmd):
            return 0, math.inf, ""  # runs until its limit
        if "build_ext" in cmd:
            return 0, 200.0, ""  # a first build: slow, and not cut for the later steps
        return 0, 5.0, "ok\n"

    machine = Machine(check, monkeypatch, cuda=True, behave=behave)
    rc, steps = _main(check, tmp_path)
    assert rc == 1
    plans = {p.name: p for p in check._plans(check._parse([]), None, tmp_path)}
    names = list(steps)
    after = names[names.index("parallel_cuda") + 1 :]
    # versions 3 x 5 s, build 210 s, 2 test steps 5 s each: 235 s spent; the hung step is cut
    # to what leaves every later step its floor.
    assert steps["build"]["seconds"] == 210
    assert steps["parallel_cuda"]["status"] == "timed out"
    (_, hung), *_ = machine.commands("tests/gpu/test_parallel_cuda.py")
    assert hung == 570 - 235 - sum(plans[n].floor for n in after)
    assert all(steps[n]["status"] == "passed" for n in after), steps
    # Every step after the build hangs: each still runs, with at least its floor, and the
    # check ends within its budget.
    hang.update(("pytest", "torch_sagemaker.bench"))
    machine.now, machine.calls = 0.0, []
    rc, steps = _main(check, tmp_path)
    assert rc == 1
    for name in names[2:]:
        assert steps[name]["status"] == "timed out", steps[name]
        assert plans[name].floor <= steps[name]["seconds"] <= plans[name].cap, steps[name]
    assert machine.now == 570
    timeline = steps["gpu_timeline"]["detail"]
    assert "--nprocs 1 --sizes 64K,1M,16M --timeline-sizes 64K: not run, out of time" in timeline


def test_out_of_time_steps_are_skipped_and_the_build_takes_what_it_needs(monkeypatch, tmp_path):
    check = _script()

    def behave(cmd):
        return (0, 90.0, "") if "build_ext" in cmd else (0, 5.0, "ok\n")

    Machine(check, monkeypatch, cuda=True, behave=behave)
    rc, steps = _main(check, tmp_path, "--budget", "150")
    # versions: 4 commands of 5 s; build: 5 + 90 + 5 s, uncut though the later steps' floors
    # add up to more than the rest; then each step runs while its floor is left.
    assert rc == 0
    assert steps["build"]["status"] == "passed" and steps["build"]["seconds"] == 100
    ran = [n for n, s in steps.items() if s["status"] == "passed"]
    assert ran[:2] == ["versions", "build"] and len(ran) < len(steps)
    skipped = [n for n, s in steps.items() if s["status"] == "skipped"]
    assert skipped and ran + skipped == list(steps)  # those that ran came first
    assert all(steps[n]["detail"] == "out of time (--budget 150 s)" for n in skipped)


def test_the_runner_and_the_junit_reader_for_real(tmp_path):
    check = _script()
    log = (tmp_path / "log").open("w")
    rc, out = check._run([sys.executable, "-c", "print('hello')"], 60, log)
    assert (rc, out) == (0, "hello\n")
    rc, out = check._run([sys.executable, "-c", "import time; time.sleep(60)"], 1, log)
    assert rc is None and out.endswith("[timed out after 1 s]\n")
    tests = tmp_path / "test_three.py"
    tests.write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert False\n"
        "def test_skips(): pytest.skip('no CUDA here')\n"
    )
    step = check.Step("three", "a test of each outcome")
    check._pytest_step(step, [str(tests)], 120, log, tmp_path)
    assert step.status == "failed"
    assert step.detail.startswith("1 failed, 1 passed, 1 skipped")
    assert sorted(step.tests.values()) == ["failure", "passed", "skipped: no CUDA here"]
    log.close()
    assert "$ " in (tmp_path / "log").read_text()
