"""The planner's time model against recorded measurements.

Records are written by ``python -m benchmarks planner time --record FILE``
(benchmarks/planner/validation_time.py): this machine's calibrated rates, the collective
costs, and the step times ``bench training`` and ``bench multihost --train`` measured. The
predictions are recomputed here with the current model, so a change that moves one outside
its tolerance fails, as tests/unit/test_cost_model.py does for the collectives.

- tests/data/planner/*.json: records taken on a quiet machine; every row must be within
  ``TIME_TOLERANCE`` (20%) of its median run (docs/planner_validation.md, "Time, against measured
  steps", has the table and the command that makes one).
- tests/data/planner/loaded/*.json: records taken while other work held this shared
  machine (their notes and load averages say so). They are not evidence of the model's
  accuracy; they check that a record's predictions are reproducible from the record alone.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import statistics

import pytest

from benchmarks.planner import calibration
from benchmarks.planner import validation_time as vt
from torch_sagemaker.planner import comm

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "planner")
COMMAND = "python -m benchmarks planner time --runs 3 --record tests/data/planner/DATE-quiet.json"


def _load(pattern: str) -> list[tuple[str, dict]]:
    found = []
    for path in sorted(glob.glob(os.path.join(DATA, pattern))):
        with open(path) as f:
            found.append((os.path.basename(path), json.load(f)))
    return found


QUIET = _load("*.json")
LOADED = _load(os.path.join("loaded", "*.json"))


def test_a_quiet_record_exists():
    assert QUIET, f"no quiet-machine record in tests/data/planner; make one: {COMMAND}"


@pytest.mark.parametrize("name, record", QUIET, ids=[name for name, _ in QUIET])
def test_every_recorded_step_time_is_within_tolerance(name, record):
    assert record["rows"] and record["calibration"], name
    off = vt.out_of_tolerance(record)
    assert not off, f"{name}: {off}\n" + vt.table(record)


def test_loaded_records_are_labelled_and_reproducible():
    assert LOADED
    for name, record in LOADED:
        assert "not evidence" in record["note"], name
        assert min(record["load_average"]["before"]) > record["cores"], name
        sources = {row["source"] for row in record["rows"]}
        assert sources == {"bench training", "bench multihost --train"}, name
        predicted = [p for _, p in vt.predict_rows(record)]
        assert all(p > 0 for p in predicted)
        assert predicted == [p for _, p in vt.predict_rows(copy.deepcopy(record))]


def test_a_prediction_outside_its_tolerance_fails():
    # Measurements made equal to the predictions, then moved by 10% (within) and 30%
    # (outside): the check passes the first and names every row of the second.
    _, record = LOADED[0]
    exact = copy.deepcopy(record)
    for row, predicted in vt.predict_rows(record):
        index = record["rows"].index(row)
        exact["rows"][index]["measured"] = [predicted] * 3
    for factor, expect_off in ((1.1, False), (1.3, True), (0.7, True)):
        moved = copy.deepcopy(exact)
        for row in moved["rows"]:
            row["measured"] = [m * factor for m in row["measured"]]
        off = vt.out_of_tolerance(moved)
        assert bool(off) is expect_off, (factor, off)
        if expect_off:
            assert len(off) == len(moved["rows"])
    # The median of the runs is what counts: one slow run of three does not fail a row.
    noisy = copy.deepcopy(exact)
    for row in noisy["rows"]:
        m = statistics.median(row["measured"])
        row["measured"] = [m, m, 3 * m]
    assert not vt.out_of_tolerance(noisy)


MODEL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
RATES = {"matmul_flops": 1e10, "bandwidth": 1e10, "adam_seconds": 1e-9}


def _step(rates: dict, backend: str = "smddp") -> float:
    spec = vt._model_spec(tuple(sorted(MODEL.items())))
    return vt.predict_step(
        spec,
        hosts=1,
        per_host=2,
        hybrid_shard_degree=2,
        seq_len=32,
        batch=1,
        rates=rates,
        costs=comm.Costs(),
        cores=2,
        backend=backend,
    )


def test_fixed_overhead_and_fsdp_bytes_add_as_the_note_says():
    # Note [Fixed overhead]: per step, per layer, per FSDP unit (layers and the root), and
    # per byte of every unit's parameters (fp32 here).
    spec = vt._model_spec(tuple(sorted(MODEL.items())))
    elements = sum(p.numel for p in spec.params if p.tied_to is None)
    layers = MODEL["num_hidden_layers"]
    base = _step(RATES)
    terms = {
        "step_overhead": (1e-3, 1.0),
        "layer_overhead": (2e-3, layers),
        "unit_overhead": (3e-3, layers + 1),
        "fsdp_byte_seconds": (1e-9, 4 * elements),
    }
    for key, (value, count) in terms.items():
        added = _step({**RATES, key: value}) - base
        assert added == pytest.approx(value * count, rel=1e-9), key
    every = _step({**RATES, **{k: v for k, (v, _) in terms.items()}}) - base
    assert every == pytest.approx(sum(v * c for v, c in terms.values()), rel=1e-9)


def test_measured_one_host_lines_price_their_backend_only():
    # A record's calibration carries each backend's measured line per collective; a row is
    # priced with its own backend's, a group of another size by the cost model.
    lines = {
        "gloo": {op: [1e-3, 1e-9] for op in ("all_gather", "reduce_scatter", "all_reduce")},
        "smddp": {op: [0.0, 1e-10] for op in ("all_gather", "reduce_scatter", "all_reduce")},
    }
    rates = {**RATES, "processes": 2, "collectives": lines}
    gloo, smddp = _step(rates, backend="gloo"), _step(rates, backend="smddp")
    assert gloo > smddp  # gloo's line is the dearer
    fabric = comm.Fabric(
        2, 1e9, 0.0, comm.Costs(), 2.0, 2, calibration.one_host_lines(rates, "gloo")
    )
    assert comm.seconds(fabric, "all_gather", 1 << 20, [0, 1]) == pytest.approx(
        1e-3 + (1 << 20) * 1e-9
    )
    assert comm.seconds(fabric, "all_to_all", 1 << 20, [0, 1]) == pytest.approx(
        1e-3 + (1 << 20) * 1e-9
    )
    plain = comm.Fabric(2, 1e9, 0.0, comm.Costs(), 2.0, 2)
    wide = comm.Fabric(4, 1e9, 0.0, comm.Costs(), 2.0, 4, fabric.one_host)
    assert comm.seconds(wide, "all_reduce", 1 << 20, [0, 1, 2, 3]) == comm.seconds(
        comm.Fabric(4, 1e9, 0.0, comm.Costs(), 2.0, 4), "all_reduce", 1 << 20, [0, 1, 2, 3]
    )
    assert comm.seconds(plain, "all_reduce", 1 << 20, [0, 1]) != comm.seconds(
        fabric, "all_reduce", 1 << 20, [0, 1]
    )
    # Records written before rows named their backend: the first word of the row's name.
    assert vt.backend_of({"name": "gloo fsdp2_full"}) == "gloo"
    assert vt.backend_of({"name": "x", "backend": "smddp"}) == "smddp"


def test_shaped_simulated_hosts_pay_their_shapers_cpu():
    # Note [Shaped cables cost CPU]: a group across simulated hosts whose cables are shaped
    # on these cores pays shaper_cpu per TCP byte; one host, or real NICs, do not.
    import dataclasses

    # A NIC fast enough that the cores, not the NIC, bound the call.
    costs = dataclasses.replace(comm.Costs(), shaper_cpu=5 * comm.Costs().net_cpu)
    real = comm.Fabric(2, 1e11, 0.0, costs, 2.0, 4)
    shaped = dataclasses.replace(real, shaper=True)
    across, inside = [0, 2], [0, 1]
    assert comm.seconds(shaped, "all_reduce", 16 << 20, across) > comm.seconds(
        real, "all_reduce", 16 << 20, across
    )
    assert comm.seconds(shaped, "all_reduce", 16 << 20, inside) == comm.seconds(
        real, "all_reduce", 16 << 20, inside
    )
    # The time validation's simulated hosts at a rate are shaped; its one-host rows are not.
    spec = vt._model_spec(tuple(sorted(MODEL.items())))
    step = {
        "spec": spec,
        "per_host": 2,
        "hybrid_shard_degree": 4,
        "seq_len": 32,
        "batch": 1,
        "rates": RATES,
        "cores": 2,
    }
    plain = vt.predict_step(hosts=2, costs=comm.Costs(), nic_bits=8e11, **step)
    dear = vt.predict_step(hosts=2, costs=costs, nic_bits=8e11, **step)
    assert dear > plain
    unshaped = [
        vt.predict_step(hosts=2, costs=c, nic_bits=1e12, **step) for c in (costs, comm.Costs())
    ]
    assert unshaped[0] == unshaped[1]
