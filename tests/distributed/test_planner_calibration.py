"""The time validation's calibration (benchmarks/planner/calibration.py) on two processes.

It runs the measurements the time model's quiet-machine records are made of: rates, the
fixed overheads of Note [Fixed overhead], and each backend's one-host collective lines.
Their values are this machine's and not checked here; their shape and signs are.
"""

from __future__ import annotations

from benchmarks.planner import calibration
from benchmarks.planner import validation_time as vt
from torch_sagemaker.planner import comm

MODEL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 16,
    "tie_word_embeddings": False,
}


def test_two_processes_calibrate_every_term_and_both_backends():
    config = vt._config(MODEL)
    rates = calibration.calibrate(2, vt.meta_spec(config), 16, config, ["gloo", "smddp"])
    assert rates["processes"] == 2
    for key in ("matmul_flops", "bandwidth", "adam_seconds", "layer_overhead", "unit_overhead"):
        assert rates[key] > 0, (key, rates)
    assert rates["step_overhead"] >= 0 and rates["fsdp_byte_seconds"] >= 0, rates
    for backend in ("gloo", "smddp"):
        lines = calibration.one_host_lines(rates, backend)
        assert {op for op, *_ in lines} == set(calibration.COLLECTIVES), lines
        for op, ranks, alpha, per_byte in lines:
            assert ranks == 2 and alpha >= 0 and per_byte > 0, (backend, op, alpha, per_byte)
    machine = calibration.machine_of(rates)
    assert machine.unit_overhead == rates["unit_overhead"]
    # The lines price the one-host collectives of the row's backend.
    fabric = comm.Fabric(
        2, 1e9, 0.0, comm.Costs(), 2.0, 2, calibration.one_host_lines(rates, "gloo")
    )
    alpha, per_byte = rates["collectives"]["gloo"]["all_reduce"]
    assert comm.seconds(fabric, "all_reduce", 1 << 24, [0, 1]) == alpha + per_byte * (1 << 24)
