"""The installed torch's release as a comparable tuple."""

from __future__ import annotations

import re

import torch


def _release(version: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a torch version string such as ``2.11.0+cu130``."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"cannot read a torch release from {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


TORCH_VERSION = _release(torch.__version__)


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is ``major.minor`` or newer."""
    return TORCH_VERSION[:2] >= (major, minor)
