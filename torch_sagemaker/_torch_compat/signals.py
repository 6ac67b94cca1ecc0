"""c10's fatal-signal handler: native stacks of every thread when a process crashes.

Checked on torch 2.13, 2.15.
"""

from __future__ import annotations

import torch


def print_native_stacks_on_fatal_signal() -> None:
    """On SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE or SIGINT, print every thread's C++ stack.

    c10 prints them to stderr and then calls the handler installed before it (Python's
    ``faulthandler``, for the Python stacks, when that was enabled first), so the process
    still ends as it would have.
    """
    torch._C._set_print_stack_traces_on_fatal_signal(True)
