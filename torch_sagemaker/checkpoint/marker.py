"""The completion marker both checkpoint locations write last, and the errors around it.

A checkpoint is complete when its marker exists (``constants.COMPLETION_MARKER``): JSON with
the format version, the size of every file (and, with checksums, its CRC-32: Note
[Checkpoint checksums] in ``integrity``), the save's id and what the saver adds (kind,
layout). How it is written differs by location (Note [Checkpoint commit protocol] in
``atomic_dir``, Note [S3 checkpoint layout] in ``s3_checkpoint``); what it holds and how it
is checked does not, and lives here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from torch_sagemaker.checkpoint import integrity
from torch_sagemaker.checkpoint.completeness import TRAINING_KINDS
from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER, FORMAT_VERSION


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not match what is loaded into it.

    Attributes:
        committed: ``True`` when a save raised although its checkpoint was committed (it is
            complete and loadable; a rank failed after the commit, Note [Commit outcome]).
    """

    def __init__(self, message: str, *, committed: bool = False) -> None:
        super().__init__(message)
        self.committed = committed


def new_marker(
    sizes: dict[str, int], checksums: dict[str, str] | None, info: dict[str, Any]
) -> bytes:
    """The marker's bytes: ``sizes`` and, unless ``None``, ``checksums`` of every file.

    Without checksums the marker is format 1 (sizes only), which loads check by size.
    """
    marker: dict[str, Any] = {"format_version": 1, "time": time.time(), "files": sizes}
    if checksums is not None:
        marker.update(
            format_version=FORMAT_VERSION,
            checksum_algorithm=integrity.ALGORITHM,
            checksums=checksums,
        )
    return json.dumps({**marker, **info}, indent=1, sort_keys=True).encode()


def read_marker_bytes(read: Callable[[], bytes], where: object, source: object) -> dict[str, Any]:
    """The marker ``read()`` returns, after checking its file table.

    Args:
        read: Reads the marker's bytes.
        where: The checkpoint, for the message.
        source: The marker's own path or URI, for the message.

    Raises:
        CheckpointError: If it cannot be read (``OSError``), is not JSON, has no file table,
            or a format-2 marker lacks the checksum of a file.
    """
    try:
        marker = json.loads(read())
        files = marker["files"]
        checksums = marker.setdefault("checksums", {})
        if (
            not isinstance(files, dict)
            or not isinstance(checksums, dict)
            or (marker.get("format_version", 1) >= 2 and set(checksums) != set(files))
        ):
            raise ValueError("its file table is malformed")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"checkpoint {where} is corrupt: its marker {source} is unreadable "
            f"({type(e).__name__}: {e}). Load an earlier checkpoint."
        ) from e
    return marker


def incomplete_error(where: object) -> CheckpointError:
    """The error for a checkpoint whose files exist but whose marker does not."""
    return CheckpointError(
        f"checkpoint {where} is incomplete: it has no completion marker {COMPLETION_MARKER} "
        "(its save did not finish, or it was not written by torch.sagemaker). Load an "
        "earlier checkpoint."
    )


def check_sizes(
    where: object, written: dict[str, int], actual: dict[str, int], prefix: str = ""
) -> None:
    """Refuses a checkpoint whose files differ from what its marker says was written.

    Args:
        where: The checkpoint, for the message.
        written: File name -> bytes written, from the marker.
        actual: File name -> bytes found now.
        prefix: Put before each name in the message (the save id on S3).

    Raises:
        CheckpointError: A file is missing or has another size, naming each one.
    """
    problems = []
    for name, size in written.items():
        if name not in actual:
            problems.append(f"{prefix}{name} is missing")
        elif actual[name] != size:
            problems.append(f"{prefix}{name} has {actual[name]} bytes, {size} were written")
    if problems:
        raise CheckpointError(f"checkpoint {where} is corrupt: " + "; ".join(problems) + ".")


def not_a_training_checkpoint(where: object, kind: object) -> CheckpointError | None:
    """The error for a complete checkpoint whose marker's ``kind`` DCP's readers cannot read.

    ``None`` for the training kinds (and for markers written before kinds, without one).
    """
    if kind is None or (isinstance(kind, str) and kind in TRAINING_KINDS):
        return None
    if kind == "hugging_face":
        return CheckpointError(
            f"checkpoint {where} is a Hugging Face export (its marker's kind is "
            "'hugging_face': config.json and safetensors written by save_hf_checkpoint), not "
            "a checkpoint of save() or TrainingState.save, so load() cannot read it. Read it "
            "with transformers' AutoModelForCausalLM.from_pretrained (a local copy of it), "
            "and resume training from a checkpoint of TrainingState.save."
        )
    return CheckpointError(
        f"checkpoint {where} is of kind {kind!r} (its marker says so), which load() does not "
        f"read: it reads the kinds {sorted(TRAINING_KINDS)} that save() and "
        "TrainingState.save write. Load a checkpoint of one of those kinds."
    )


def replaced_error(
    where: object, before: str | None, after: str | None, *, reader: bool = False
) -> CheckpointError:
    """The error for a checkpoint another save committed over while it was being read.

    Note [A save that replaces a checkpoint being loaded] in ``state_dict_loader``.

    Args:
        where: The checkpoint.
        before: The save id its marker named when the read began.
        after: The save id it names now (``None``: no readable marker).
        reader: Raised by a ``DistributedFileSystemReader`` (made before that save).
    """
    now = (
        f"{after} after"
        if after is not None
        else "no readable marker after: a save replacing it, or a read error"
    )
    return CheckpointError(
        f"loading {where}: another save committed over this checkpoint while it was being "
        f"read (save id {before} before, {now}), so the loaded values may mix the two saves. "
        f"Load it again{' with a new DistributedFileSystemReader' if reader else ''}, and do "
        "not save under a name that is being loaded (give each save its own directory, e.g. "
        "one per step)."
    )


def corrupt_error(where: object, problems: list[str]) -> CheckpointError:
    """The error for files whose checksum no longer matches (``where``: the checkpoint)."""
    return CheckpointError(
        f"checkpoint {where} is corrupt: " + "; ".join(problems) + ". Loading it would give "
        "wrong values; load an earlier checkpoint, or copy this one again from its source."
    )


__all__ = [
    "CheckpointError",
    "check_sizes",
    "corrupt_error",
    "incomplete_error",
    "new_marker",
    "read_marker_bytes",
    "replaced_error",
]
