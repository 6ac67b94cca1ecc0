"""The smddp settings: one table (C++), typed options, strict parsing of the environment,
and the docs table generated from it."""

import dataclasses
import os
from datetime import timedelta

import pytest

from torch_sagemaker.smddp import backend
from torch_sagemaker.smddp.options import (
    SMDDPOptions,
    resolve,
    setting_table,
    settings_markdown,
)

pytestmark = pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built")

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "collectives.md")
BEGIN, END = "<!-- settings table: generated, do not edit -->\n", "<!-- end of settings table -->"


def test_docs_table_is_generated_from_the_backend_table():
    with open(DOCS) as f:
        text = f.read()
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert table == settings_markdown(), "regenerate: python -m torch_sagemaker.smddp.options"


def test_options_fields_are_the_table_fields():
    assert [f.name for f in dataclasses.fields(SMDDPOptions)] == [
        r["field"] for r in setting_table()
    ]


def test_defaults():
    s = resolve(None, {})
    assert s["buffer_bytes"] == str(1 << 20) and s["pool_bytes"] == str(1 << 30)
    assert s["p2p_bytes"] == str((1 << 20) + (64 << 10))
    assert s["chunk_bytes"] == "auto" and s["stream_bytes"] == "auto"
    assert s["move_off_cpu"] == "0"  # moving threads between CPUs is opt-in


def test_environment_and_options_with_units():
    s = resolve(
        None,
        {
            "SMDDP_BUFFER_BYTES": "4M",
            "SMDDP_POOL_BYTES": "0",
            "SMDDP_SPIN_US": "0",
            "SMDDP_MOVE_OFF_CPU": "yes",
            "SMDDP_CHUNK_BYTES": "64KiB",
        },
    )
    assert s["buffer_bytes"] == str(4 << 20) and s["pool_bytes"] == "0" and s["spin_us"] == "0"
    assert resolve(None, {"SMDDP_POOL_BYTES": "1T"})["pool_bytes"] == str(1 << 40)  # the limit
    assert s["move_off_cpu"] == "1" and s["chunk_bytes"] == str(64 << 10)
    # Options win over the environment; timedelta and bool are converted.
    s = resolve(
        SMDDPOptions(buffer_bytes=8192, timeout=timedelta(seconds=2.5), move_off_cpu=False),
        {"SMDDP_BUFFER_BYTES": "4M", "SMDDP_MOVE_OFF_CPU": "1"},
    )
    assert s["buffer_bytes"] == "8192" and s["timeout"] == "2.5" and s["move_off_cpu"] == "0"
    assert resolve(None, {})["connect_attempt_timeout"] == "20"
    assert resolve(None, {"SMDDP_CONNECT_ATTEMPT_TIMEOUT": "60"})["connect_attempt_timeout"] == "60"
    s = resolve(SMDDPOptions(connect_attempt_timeout=1.5), {"SMDDP_CONNECT_ATTEMPT_TIMEOUT": "3"})
    assert s["connect_attempt_timeout"] == "1.5"


@pytest.mark.parametrize(
    "environ, words",
    [
        ({"SMDDP_BUFFER_BYTES": "12x"}, ["SMDDP_BUFFER_BYTES=12x", "byte count"]),
        ({"SMDDP_POOL_BYTES": "-1"}, ["SMDDP_POOL_BYTES=-1", "byte count"]),
        ({"SMDDP_BUFFER_BYTES": "100"}, ["SMDDP_BUFFER_BYTES=100", "between 4K and 1G"]),
        ({"SMDDP_P2P_BYTES": "100"}, ["SMDDP_P2P_BYTES=100", "0 or between 4K and 1G"]),
        ({"SMDDP_POOL_BYTES": "2T"}, ["SMDDP_POOL_BYTES=2T", "must be between 0 and 1T"]),
        ({"SMDDP_BUFFER_BYTES": "99999999999999999999"}, ["64 bits"]),
        ({"SMDDP_BUFFER_BYTES": "20000000000G"}, ["63 bits"]),
        ({"SMDDP_SPIN_US": "2e3"}, ["SMDDP_SPIN_US=2e3", "whole number"]),
        ({"SMDDP_SPIN_US": "99999999999999999999999"}, ["at most 1000000"]),
        ({"SMDDP_MOVE_OFF_CPU": "maybe"}, ["SMDDP_MOVE_OFF_CPU=maybe", "1 or 0"]),
        ({"SMDDP_FORCE_LOCAL_SIZE": " 2"}, ["SMDDP_FORCE_LOCAL_SIZE= 2"]),
        ({"SMDDP_SOCKET_ADDR": "10.0.0.1", "SMDDP_SOCKET_IFNAME": "eth0"}, ["set one of them"]),
        (
            {"SMDDP_CONNECT_ATTEMPT_TIMEOUT": "0.05"},
            ["SMDDP_CONNECT_ATTEMPT_TIMEOUT=0.05", "between 0.1 and 60 seconds"],
        ),
        ({"SMDDP_CONNECT_ATTEMPT_TIMEOUT": "60.1"}, ["between 0.1 and 60 seconds"]),
        ({"SMDDP_CONNECT_ATTEMPT_TIMEOUT": "20s"}, ["positive number of seconds"]),
        ({"SMDDP_CONNECT_ATTEMPT_TIMEOUT": "0x10"}, ["positive number of seconds"]),
        ({"SMDDP_CONNECT_ATTEMPT_TIMEOUT": " 5"}, ["positive number of seconds"]),
    ],
)
def test_malformed_environment_raises_naming_the_variable(environ, words):
    with pytest.raises(ValueError) as info:
        resolve(None, environ)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_malformed_options_raise_naming_the_option():
    with pytest.raises(ValueError, match="SMDDPOptions.chunk_bytes=12 is invalid"):
        resolve(SMDDPOptions(chunk_bytes=12), {})
    with pytest.raises(ValueError, match="SMDDPOptions.timeout=-1"):
        resolve(SMDDPOptions(timeout=-1), {})
    # True is an int in Python, but only the flags take it (as 1); it was read as spin_us=1.
    with pytest.raises(ValueError, match="SMDDPOptions.spin_us=True is invalid: expected a whole"):
        resolve(SMDDPOptions(spin_us=True), {})
    with pytest.raises(ValueError, match="SMDDPOptions.buffer_bytes=True is invalid: expected a"):
        resolve(SMDDPOptions(buffer_bytes=True), {})
    flags = resolve(SMDDPOptions(move_off_cpu=True, timeline=True, stage_cpu=True), {})
    assert flags["move_off_cpu"] == flags["timeline"] == flags["stage_cpu"] == "1"
