"""Private names of ``torch.compile``: failing a compilation from traced code.

Checked on torch 2.13, 2.15.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def fail_compilation(message: Callable[[], str]) -> None:
    """Raises ``RuntimeError(message())`` in eager code and while Dynamo traces.

    A plain ``raise`` in code that Dynamo traces becomes a graph break, after which the code
    runs eagerly (where a check on ``torch.compiler.is_compiling()`` no longer holds);
    ``torch._check`` with a constant ``False`` fails the compilation itself.
    """
    torch._check(False, message)


__all__ = ["fail_compilation"]
