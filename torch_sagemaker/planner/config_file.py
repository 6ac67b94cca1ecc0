"""A Hugging Face ``config.json`` read for the planner: locally, never downloaded, and checked.

transformers validates a config's fields; this adds the sizes the planner reads (positive
integers, one value for every layer) and says, in one line, which value breaks which rule.
"""

from __future__ import annotations

import json
import os
from typing import Any

try:  # transformers' config validation raises these (huggingface_hub is its dependency)
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # an older huggingface_hub: transformers raises ValueError itself
    StrictDataclassError = ValueError  # type: ignore[misc,assignment]


def read_config(path: str | os.PathLike[str]) -> Any:
    """The Hugging Face config in ``path`` (a ``config.json`` or a directory holding one).

    Only the local file is read; nothing is downloaded.

    Raises:
        ValueError: If the file is missing, is not JSON, names no known ``model_type``, or
            holds values transformers refuses or sizes that are not positive integers.
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read model config {path!r}: {e.strerror}.") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"model config {path!r} is not JSON: {e.msg} at line {e.lineno}."
        ) from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(
            f"model config {path!r} has no model_type; give a Hugging Face config.json "
            '(e.g. {"model_type": "llama", "hidden_size": ...}).'
        )
    model_type = data["model_type"]
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        import transformers

        raise ValueError(
            f"model config {path!r}: model_type={model_type!r} is not a family transformers "
            f"{transformers.__version__} knows (the planner runs no code from the checkpoint). "
            "Fix the config."
        )
    try:
        # transformers' own reader, as from_pretrained reads a checkpoint: it decodes what
        # its writer encodes (an infinite float as {"__float__": "Infinity"}: Bamba's,
        # Falcon-H1's and Nemotron-H's time_step_limit), which keyword arguments to the
        # config class do not. The path is a local file, so nothing is downloaded, and an
        # auto_map's code is never run (nor asked about on the terminal).
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (ValueError, TypeError, StrictDataclassError) as e:
        # transformers validates its configs' fields and architecture with huggingface_hub's
        # strict dataclasses, whose errors span lines ("Validation error for field ...:\n
        # TypeError: ..."): the last line is the rule broken.
        raise ValueError(f"model config {path!r}: {_last_line(e)} Fix the config.") from None
    _check_sizes(config, path)
    return config


def _last_line(error: Exception) -> str:
    """The rule an error reports, one sentence: its last line, without an exception name."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    line = lines[-1].strip()
    name, sep, rest = line.partition(": ")
    if sep and name.endswith("Error") and name.isidentifier():
        line = rest
    return line if line.endswith(".") else line + "."


#: Sizes the planner and the model's constructor read: each, where the config has it, a
#: positive integer (``head_dim`` may also be unset; transformers then derives it).
_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
)


# Note [One size per layer]: the memory and time models size one layer and count it
# num_hidden_layers times (layer_types aside: sliding-window layers keep a window of
# scores). transformers 5.24 lets a config set attributes layer by layer: its per-layer
# overrides (``per_layer_config``; Gemma 4's full-attention layers have heads twice as wide)
# or, for some sizes, a list (Gemma 3n's ``intermediate_size``). Reading an overridden
# attribute's global value raises in transformers, and any one value would describe the other
# layers wrongly; a list, even of equal values, is a form the planner's sizes do not read.
# So the planner refuses these configs in one line naming the attributes and their values,
# rather than guess.
_ONE_SIZE_PER_LAYER = (
    "the planner sizes one layer and counts it for every layer (Note [One size per layer]), "
    "so it cannot plan this config"
)


def _values(values: list[Any], unit: str = "layers") -> str:
    """Distinct values, in words: ``"256 or 512"``, ``"16384 on all 35 layers"``."""
    distinct: list[Any] = []
    for v in values:
        if v not in distinct:
            distinct.append(v)
    try:
        distinct.sort()
    except TypeError:  # values without an order (None beside ints): as the layers give them
        pass
    if len(distinct) == 1:
        return f"{distinct[0]!r} on all {len(values)} {unit}"
    return " or ".join(repr(v) for v in distinct)


def _check_one_size_per_layer(config: Any, path: str) -> None:
    """Refuses a config with transformers' per-layer overrides (Note [One size per layer]).

    Raises:
        ValueError: Naming each attribute set per layer and its values.
    """
    varying = sorted(getattr(config, "per_layer_attributes", None) or ())
    if not varying:
        return
    layers: Any = getattr(config, "per_layer_config", None)
    count = getattr(config, "num_hidden_layers", 0)
    described = []
    sizes_only = True
    for attr in varying:
        try:
            values = [getattr(layers[i], attr) for i in range(count)]
        except Exception:  # noqa: BLE001 - the name alone still says why
            described.append(attr)
            sizes_only = False
            continue
        described.append(f"{attr} ({_values(values)})")
        sizes_only = sizes_only and all(type(v) is int for v in values)
    # A copy with one value for every layer bounds the model where the values are sizes.
    # (Gemma 4's config rebuilds per_layer_config from global_head_dim when the key is
    # missing, so the copy must keep the key, empty.)
    bound = (
        '. To bound the model, plan a copy with "per_layer_config": {} whose global value is '
        "the largest of those"
        if sizes_only
        else ""
    )
    raise ValueError(
        f"model config {path!r}: {type(config).__name__} sets {', '.join(described)} per "
        f"layer (per_layer_config); {_ONE_SIZE_PER_LAYER}{bound}."
    )


def _check_sizes(config: Any, path: str) -> None:
    """Refuses sizes a model cannot be built or planned with (transformers accepts some).

    Raises:
        ValueError: Naming the attribute, its value and the rule.
    """
    getter = getattr(config, "get_text_config", None)
    configs = [config]
    try:
        text = getter(decoder=True) if callable(getter) else None
    except ValueError:  # several text configs: the top-level one is all there is to check
        text = None
    if text is not None and text is not config:
        configs.append(text)
    for c in configs:
        _check_one_size_per_layer(c, path)
        for attr in _SIZES:
            value = getattr(c, attr, None)
            if value is None:
                continue
            if isinstance(value, (list, tuple)):
                per_layer = len(value) == getattr(c, "num_hidden_layers", None)
                raise ValueError(
                    f"model config {path!r}: {type(c).__name__} gives {attr} as a list"
                    f"{', one per layer' if per_layer else ''} "
                    f"({_values(list(value), 'layers' if per_layer else 'entries')}), a "
                    "form the planner does not read (Note [One size per layer]), so it cannot "
                    "plan this config."
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                why = " (the planner plans its layers)" if attr == "num_hidden_layers" else ""
                raise ValueError(
                    f"model config {path!r}: {attr}={value!r} must be a positive integer{why}."
                    " Fix the config."
                )


__all__ = ["read_config"]
