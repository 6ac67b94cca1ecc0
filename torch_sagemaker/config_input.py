"""Where an SMP config comes from: ``tsm.init``'s argument and ``SM_HP_MP_PARAMETERS``.

``load_raw`` merges the sources into one dict without judging its values
(``torch_sagemaker.config.validate`` does that). No input escapes as a raw Python error:
files are read in bounded size, without waiting on a pipe or FIFO without a bound, and
decoded as JSON text (UTF-8, or UTF-16/32 as ``json`` detects them); integers too long to
convert, nesting too deep to parse and values too large to print all become
``ConfigError`` problems (values are shown through ``show_value``).

``ConfigError`` and ``show_value`` live here because reading raises them first; the
validation in ``config.py`` and the environment switches in ``env_settings.py`` use them
too.
"""

from __future__ import annotations

import json
import os
import reprlib
import select
import time
from collections.abc import Mapping
from typing import Any

ENV_VAR = "SM_HP_MP_PARAMETERS"
#: Largest config file or environment value read (an SMP config is a few hundred bytes).
MAX_CONFIG_BYTES = 1 << 20
#: Seconds a config path that is a pipe may take to deliver its text (``<(...)`` in bash).
CONFIG_PIPE_WAIT_S = 10.0


class ConfigError(ValueError):
    """Raised with every configuration problem at once.

    Attributes:
        problems: One human-readable line per problem.
    """

    def __init__(self, problems: list[str], source: str = "SMP config") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"Invalid {source} ({len(problems)} problem(s)):\n{lines}")


class _ValueRepr(reprlib.Repr):
    """``repr`` bounded in length and depth, and safe for integers of any size."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, 60, 60, 40

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:  # repr() itself refuses ints of more than 4300 digits
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_VALUE_REPR = _ValueRepr()


def show_value(value: Any) -> str:
    """How an error message shows a config value: its ``repr``, shortened if huge or deep."""
    if isinstance(value, bool):
        return repr(value)
    return _VALUE_REPR.repr(value)


def _parse_json(text: str, source: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            [
                f"{source} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} "
                f"(character {e.pos}). Fix the JSON there, e.g. quote keys and drop trailing "
                "commas."
            ],
            source,
        ) from None
    except RecursionError:
        raise ConfigError(
            [
                f"{source} nests arrays or objects too deeply to parse. An SMP config is one flat "
                'JSON object like {"tensor_parallel_degree": 2}; remove the nesting.'
            ],
            source,
        ) from None
    except ValueError as e:  # int() refuses integers of more than sys.get_int_max_str_digits()
        raise ConfigError(
            [
                f"{source} holds a number too long to read ({e}). Every SMP parameter is a small "
                "integer or a boolean; fix the value."
            ],
            source,
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            [
                f'{source} must hold a JSON object like {{"tensor_parallel_degree": 2}}, '
                f"got {json.dumps(value)[:40]} (a JSON {_json_kind(value)})."
            ],
            source,
        )
    return value


def _json_kind(value: Any) -> str:
    """JSON's name for the kind of a decoded value (``null``, string, array, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else type(value).__name__


def _from_argument(config: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            data = _read_bounded(path, MAX_CONFIG_BYTES + 1, CONFIG_PIPE_WAIT_S)
        except TimeoutError:  # (an OSError)
            raise ConfigError(
                [
                    f"config file {path!r} is a pipe that gave no end of text within "
                    f"{CONFIG_PIPE_WAIT_S:g} s. Pass the path of a JSON file."
                ],
                "tsm.init config",
            ) from None
        except OSError as e:
            raise ConfigError(
                [f"cannot read config file {path!r}: {e.strerror}."], "tsm.init config"
            ) from None
        except ValueError:  # the path itself is not one the OS takes
            raise ConfigError(
                [
                    f"cannot read config file {path!r}: the path contains a NUL byte. Pass "
                    "the path of the JSON file with the SMP parameters."
                ],
                "tsm.init config",
            ) from None
        return _parse_json(_decode(data, f"config file {path!r}"), f"config file {path!r}")
    raise TypeError(
        "tsm.init(config=...) takes a dict, a path to a JSON file or None, "
        f"got {type(config).__name__}."
    )


def _read_bounded(path: str, limit: int, wait_s: float) -> bytes:
    """Up to ``limit`` bytes of ``path``, never waiting on it without a bound.

    Opened without blocking: a FIFO nobody writes to reads as empty at once (a plain
    ``open`` would wait for a writer forever); a pipe that is being written to (bash's
    ``<(...)``) gets ``wait_s`` to deliver its text.

    Raises:
        OSError: If the path cannot be opened or read (a directory, a missing file).
        ValueError: If the path contains a NUL byte.
        TimeoutError: If a pipe gave neither data nor its end within ``wait_s``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        chunks: list[bytes] = []
        total = 0
        deadline = time.monotonic() + wait_s
        while total < limit:
            try:
                chunk = os.read(fd, limit - total)
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError(path) from None
                continue
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _decode(data: bytes, source: str) -> str:
    """The JSON text of a config file: bounded, UTF-8 (with or without BOM), UTF-16 or UTF-32."""
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            [
                f"{source} is larger than {MAX_CONFIG_BYTES} bytes; an SMP config is a "
                "small JSON object. Pass the JSON file with the SMP parameters."
            ],
            source,
        )
    encoding = json.detect_encoding(data)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise ConfigError(
            [
                f"{source} is not JSON text: byte {data[e.start]:#04x} at position {e.start} "
                "is not "
                f"valid {encoding} (is it a binary file?). Save the config as a UTF-8 JSON file."
            ],
            source,
        ) from None


def load_raw(
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Merges the config sources into one raw dict, without validating values.

    Args:
        config: The argument of ``tsm.init``: a dict, a JSON file path, or ``None``.
        environ: Environment to read ``SM_HP_MP_PARAMETERS`` from (default ``os.environ``).
        overrides: Values assigned on ``tsm.state`` before ``tsm.init()``; they win.

    Returns:
        The merged dict (may contain unknown keys; ``validate`` reports them).

    Raises:
        ConfigError: If the file or the environment value is not a JSON object.
        TypeError: If ``config`` is of an unsupported type.
    """
    environ = os.environ if environ is None else environ
    merged = _from_argument(config)
    env_text = environ.get(ENV_VAR)
    if env_text is not None and env_text.strip():
        source = f"environment variable {ENV_VAR}"
        if len(env_text) > MAX_CONFIG_BYTES:
            raise ConfigError(
                [
                    f"{source} is longer than {MAX_CONFIG_BYTES} characters; it should "
                    "hold a small JSON object of SMP parameters."
                ],
                source,
            )
        merged.update(_parse_json(env_text, source))
    merged.update(overrides or {})
    return merged
