"""Hostile or odd config inputs end in a ``ConfigError`` naming the value, the rule and a fix.

Each case used to escape as a raw Python error (``TypeError`` from difflib, ``UnicodeDecodeError``,
``ValueError`` from int conversion, ``RecursionError``) or, for UTF-16 files, to refuse a
valid JSON file.
"""

from __future__ import annotations

import json

import pytest

from torch_sagemaker.config import ENV_VAR, MAX_CONFIG_BYTES, ConfigError, load, show_value


def _problems(excinfo) -> str:
    return "\n".join(excinfo.value.problems)


@pytest.mark.parametrize("key", [1, None, ("a",), 2.5])
def test_non_string_keys_are_named(key):
    with pytest.raises(ConfigError) as e:
        load({key: 2, "tensor_parallel_degree": 1})
    text = _problems(e)
    assert f"key {key!r} ({type(key).__name__}): config keys must be strings" in text
    assert "tensor_parallel_degree" in text  # the fix lists the valid keys


def test_binary_file_is_not_json_text(tmp_path):
    path = tmp_path / "weights.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    with pytest.raises(ConfigError) as e:
        load(path)
    assert "is not JSON text: byte 0x89 at position 0 is not valid utf-8" in _problems(e)
    assert "Save the config as a UTF-8 JSON file" in _problems(e)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-8-sig"])
def test_utf16_utf32_and_bom_files_are_read(tmp_path, encoding):
    path = tmp_path / "smp.json"
    path.write_bytes(json.dumps({"tensor_parallel_degree": 2}).encode(encoding))
    assert load(path).tensor_parallel_degree == 2


def test_oversized_file_is_refused_without_reading_it_all(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b" " * (MAX_CONFIG_BYTES + 10) + b"{}")
    with pytest.raises(ConfigError, match=f"larger than {MAX_CONFIG_BYTES} bytes"):
        load(path)


def test_5000_digit_integers(tmp_path):
    path = tmp_path / "digits.json"
    path.write_text('{"tensor_parallel_degree": ' + "7" * 5000 + "}")
    with pytest.raises(ConfigError) as e:
        load(path)
    assert "holds a number too long to read" in _problems(e)
    with pytest.raises(ConfigError) as e:  # the same value given as a dict
        load({"tensor_parallel_degree": 10**5000, "random_seed": -(10**5000)}, world_size=4)
    text = _problems(e)
    assert "tensor_parallel_degree=<an integer of 16610 bits>: must be at most 2**31 - 1" in text
    assert "random_seed=<an integer of 16610 bits>: must be in [0, 2**63 - 1]" in text


def test_deeply_nested_json_in_file_env_and_dict(tmp_path):
    deep = '{"tensor_parallel_degree": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = tmp_path / "deep.json"
    path.write_text(deep)
    with pytest.raises(ConfigError, match="nests arrays or objects too deeply"):
        load(path)
    with pytest.raises(ConfigError, match=f"{ENV_VAR} nests arrays or objects too deeply"):
        load(None, environ={ENV_VAR: deep})
    nested: list = []
    for _ in range(10_000):
        nested = [nested]
    with pytest.raises(ConfigError) as e:
        load({"tensor_parallel_degree": nested})
    assert "tensor_parallel_degree=[[[[...]]]]: must be an integer, got list" in _problems(e)


def test_long_env_value_and_many_unknown_keys():
    with pytest.raises(ConfigError, match=f"{ENV_VAR} is longer than"):
        load(None, environ={ENV_VAR: " " * (MAX_CONFIG_BYTES + 1) + "{}"})
    with pytest.raises(ConfigError) as e:
        load({f"k{i}": i for i in range(1000)} | {"x" * 100_000: 1})
    problems = e.value.problems
    assert len(problems) == 21 and problems[-1] == "... and 981 more unknown keys."


def test_show_value_is_bounded():
    assert show_value(3) == "3" and show_value(True) == "True" and show_value("a") == "'a'"
    assert len(show_value("y" * 10_000)) < 80
    assert show_value(2**200) == "<an integer of 201 bits>"
