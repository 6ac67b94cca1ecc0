"""tools/perf_split.py: the window and the split of a system-wide perf profile."""

from __future__ import annotations

import pytest

from tools import perf_split

C = "/repo/torch_sagemaker/_C.cpython-311-x86_64-linux-gnu.so"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
KERNEL = "[kernel.kallsyms]"
PY = "/usr/lib/libpython3.11.so.1.0"


def _line(t: float, sym: str, dso: str, comm: str = "python") -> str:
    return f"          {comm} 101 {t:.6f}:      7fe9cb7f13e0 {sym}+0x1a ({dso})"


def test_the_window_is_the_reduction_and_each_sample_lands_in_its_category():
    lines = [
        _line(1.0, "_PyEval_EvalFrameDefault", PY),  # start-up: before the window
        _line(2.0, "smddp::(anonymous namespace)::k_f32", C),
        _line(2.1, "__memmove_avx512_unaligned_erms", LIBC),
        _line(2.2, "_copy_from_iter", KERNEL),
        _line(2.3, "_copy_to_iter", KERNEL),
        _line(2.4, "tcp_sendmsg_locked", KERNEL),
        _line(2.5, "_raw_spin_unlock_irqrestore", KERNEL),
        _line(2.6, "do_syscall_64", KERNEL),
        _line(2.7, "do_sched_yield", KERNEL),
        _line(2.8, "smddp::ShmComm::wait_word", C),
        _line(2.82, "c10::function_ref<void (long, long)>::callback_fn<x>", "/t/libc10.so"),
        _line(2.85, "pv_native_safe_halt", KERNEL, comm="swapper"),
        _line(2.9, "smddp::(anonymous namespace)::k_bf16", C),
        _line(3.5, "gc_collect_main", PY),  # after the window
        "garbage that is not a sample",
    ]
    samples = perf_split.parse(lines)
    assert len(samples) == 14
    inside = perf_split.window(samples)
    assert [s.time for s in inside] == [
        2.0,
        2.1,
        2.2,
        2.3,
        2.4,
        2.5,
        2.6,
        2.7,
        2.8,
        2.82,
        2.85,
        2.9,
    ]
    counts, functions = perf_split.split(inside)
    assert counts == {
        "reduction (smddp's kernels)": 2,
        "copies in user space": 1,
        "copies to and from socket buffers": 2,
        "kernel TCP/IP path": 2,
        "syscall entry and exit": 1,
        "polling and waiting": 2,
        "idle": 1,
        "other user space": 1,
    }
    assert functions["kernel TCP/IP path"]["_raw_spin_unlock_irqrestore"] == 1
    assert "c10::function_ref<void (long, long)>::callback_fn<x>" in functions["other user space"]
    table = perf_split.table(samples)
    assert "92% busy" in table and "| reduction (smddp's kernels) | 18% |" in table


def test_a_profile_without_a_reduction_is_refused_with_the_fix():
    samples = perf_split.parse([_line(1.0, "tcp_sendmsg_locked", KERNEL)])
    with pytest.raises(ValueError, match="record a reducing collective"):
        perf_split.window(samples)
