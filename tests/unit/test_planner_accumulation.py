"""Gradient accumulation in the planner: micro-batches, their memory and their time.

Note [Accumulation the planner plans] in torch_sagemaker/planner/candidates.py: each
micro-batch reduce-scatters its gradients into the shards, so from the second on they are
held through forward and backward; FSDP2 all-reduces over the replicas once a step, FSDP1
after every micro-batch. Without a limit the search gives each configuration the fewest
micro-batches that fit, found by bisection, which rests on the monotony checked here.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.unit.test_planner import LLAMA_70B, MIXTRAL
from torch_sagemaker.planner import cli, plan, report
from torch_sagemaker.planner.candidates import Candidate, Checked, Rejected, check, divisors
from torch_sagemaker.planner.inputs import Cluster, Workload
from torch_sagemaker.planner.model import load_model
from torch_sagemaker.planner.presets import accelerator
from torch_sagemaker.planner.search import accelerator_machine, evaluate, fabric_of

# Llama 70B, one layout: every rank in one shard group, TP 1, checkpointing, FSDP2.
ONE_LAYOUT = {
    "hybrid_shard_degree": (256,),
    "tensor_parallel_degree": (1,),
    "context_parallel_degree": (1,),
    "fsdp": (2,),
    "activation_checkpointing": (True,),
    "activation_offloading": (False,),
}


def _config(tmp_path, name, config):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_model(_config(tmp_path_factory.mktemp("configs"), "llama70b", LLAMA_70B))


def _plan(spec, tokens, **limits):
    return plan(
        spec,
        seq_len=4096,
        global_batch_tokens=tokens,
        hosts=32,
        instance_type="p5.48xlarge",
        limits={**ONE_LAYOUT, **limits},
    )


def test_the_search_gives_each_configuration_the_fewest_micro_batches_that_fit(llama):
    # 32 sequences of 4096 per rank: in one forward they need far more than 80 GiB.
    tokens = 32 * 256 * 4096
    chosen = _plan(llama, tokens)
    assert len(chosen.ranked) == 1
    best = chosen.best
    assert best is not None and best.candidate.accumulation_steps > 2  # bisected, not 1 or 2
    # Every count on its own, as a limit names them: the chosen one is the fewest that fit,
    # with the same prediction as when it is asked for.
    alone = {k: _plan(llama, tokens, gradient_accumulation_steps=(k,)).ranked[0] for k in
             divisors(32)}  # fmt: skip
    fitting = [k for k, e in alone.items() if e.fits]
    assert best.candidate.accumulation_steps == min(fitting), {k: e.fits for k, e in alone.items()}
    same = alone[min(fitting)]
    assert (best.memory, best.time) == (same.memory, same.time)
    assert best.checked.micro_batch * best.candidate.accumulation_steps == 32
    assert f"ga{best.candidate.accumulation_steps}" in best.candidate.label()
    assert report.evaluated_json(best)["script"]["gradient_accumulation_steps"] == min(fitting)
    # Where one micro-batch fits, it is kept: 4Mi tokens, 4 sequences per rank.
    small = _plan(llama, 4 * 2**20).best
    assert small is not None and small.candidate.accumulation_steps == 1
    assert small.checked.micro_batch == 4 and "ga" not in small.candidate.label()


def test_where_nothing_fits_the_count_shown_needs_the_least_memory(llama):
    # TP 1 and 16 ranks per shard group: the model state alone exceeds 80 GiB. With 32
    # sequences a rank, one sequence per forward needs the least; with 2 under FSDP1, holding
    # the fp32 gradients through a second micro-batch costs more than its activations save,
    # and one micro-batch is shown.
    for sequences, fsdp, steps in ((32, 2, 32), (2, 1, 1)):
        limits = {"hybrid_shard_degree": (16,), "fsdp": (fsdp,)}
        p = _plan(llama, sequences * 256 * 4096, **limits)
        (e,) = p.ranked
        assert not e.fits and e.candidate.accumulation_steps == steps, sequences
        alone = [
            _plan(llama, sequences * 256 * 4096, **limits, gradient_accumulation_steps=(k,))
            .ranked[0].memory.peak
            for k in divisors(sequences)
        ]  # fmt: skip
        assert e.memory.peak == min(alone), sequences


def _cases(tmp_path):
    """(spec, cluster, workload, candidate) with 8 sequences per data-parallel rank: FSDP1 and
    FSDP2, with and without replicas, TP and CP, checkpointing and offloading, and Mixtral's
    experts over EP with an MoEConfig."""
    llama = load_model(_config(tmp_path, "llama", {**LLAMA_70B, "num_hidden_layers": 8}))
    mixtral = load_model(_config(tmp_path, "mixtral", MIXTRAL))
    cluster = Cluster(hosts=2, per_host=8, accelerator=accelerator("H100"))
    cases = []
    for fsdp in (1, 2):
        for hsd, tp, cp in ((16, 1, 1), (4, 2, 1), (8, 1, 2), (1, 1, 1)):
            dp = 16 // (tp * cp)
            workload = Workload(2048, 2048 * 8 * dp)
            for ac, offload in ((True, False), (False, False), (True, True)):
                candidate = Candidate(hsd, tp, cp, 1, fsdp, ac, offload, 2)
                cases.append((llama, cluster, workload, candidate))
        cases.append((mixtral, cluster, Workload(2048, 2048 * 8 * 16), Candidate(2, 1, 1, 8, fsdp,
                      moe=True)))  # fmt: skip
    return cases


def _at(spec, cluster, workload, candidate, steps):
    checked = check(dataclasses.replace(candidate, accumulation_steps=steps), spec, cluster,
                    workload)  # fmt: skip
    assert isinstance(checked, Checked), checked
    machine = accelerator_machine(cluster.accelerator, workload.dtype, 0.5)
    return evaluate(spec, checked, cluster, workload, machine, fabric_of(cluster))


def test_more_micro_batches_never_predict_a_faster_step_nor_from_two_on_more_memory(tmp_path):
    # What the bisection and "the fewest that fit is the fastest" rest on.
    for spec, cluster, workload, candidate in _cases(tmp_path):
        runs = [_at(spec, cluster, workload, candidate, k) for k in (1, 2, 4, 8)]
        steps = [e.time.step for e in runs]
        peaks = [e.memory.peak for e in runs[1:]]
        assert steps == sorted(steps), (candidate, steps)
        assert peaks == sorted(peaks, reverse=True), (candidate, peaks)
        # The same FLOPs and optimizer whatever the split; activations by the micro-batch.
        one = runs[0]
        for e in runs[1:]:
            assert e.time.flops == pytest.approx(one.time.flops, rel=1e-12), candidate
            assert e.time.optimizer == one.time.optimizer
            assert e.memory.activations < one.memory.activations


def test_later_micro_batches_hold_the_gradients_and_fsdp2_all_reduces_once(tmp_path):
    all_reduces, held, gradients = {}, {}, {}
    for spec, cluster, workload, candidate in _cases(tmp_path):
        one, two, four = (_at(spec, cluster, workload, candidate, k) for k in (1, 2, 4))
        m = two.memory
        # The gradients held through later micro-batches: the fp32 shards, or under FSDP2
        # with replicas the partial sums in the reduction's dtype (bf16 here); the peak is
        # at least those with the activations, or the end of the last backward.
        held[candidate], gradients[candidate] = m.held_gradients, m.gradients
        assert one.memory.held_gradients == 0
        assert m.held_gradients in (m.gradients, m.gradients // 2), candidate
        state = m.parameters + m.optimizer + m.buffers
        during = m.peak - state
        assert during >= m.held_gradients + m.activations + m.transient, candidate
        # The end of the last backward: the gradients, and FSDP2's bf16 all-reduce buffers
        # where it has replicas (as many bytes as the partial sums).
        partial = m.held_gradients if m.held_gradients < m.gradients else 0
        assert during == m.held_gradients + m.activations + m.transient or (
            during > m.gradients + partial
        ), candidate
        # FSDP's collectives: G per micro-batch (gathers and reduce-scatters), and the
        # all-reduce over the replicas, A: once a step under FSDP2, per micro-batch under FSDP1.
        f1, f2, f4 = (e.time.comm["fsdp"] for e in (one, two, four))
        per_micro = (f4 - f2) / 2
        if candidate.fsdp == 1:
            assert f2 == pytest.approx(2 * f1, rel=1e-9), candidate
            assert f4 == pytest.approx(4 * f1, rel=1e-9), candidate
        else:
            all_reduce = f1 - per_micro
            assert f2 == pytest.approx(2 * per_micro + all_reduce, rel=1e-9), candidate
            all_reduces[candidate] = all_reduce / f1
    # Two replicas of 4 x TP 2, and 16 replicas of one rank: an all-reduce; one shard group
    # of 16: none.
    assert all_reduces[Candidate(4, 2, 1, 1, 2, True, False, 2)] > 0.01
    assert all_reduces[Candidate(1, 1, 1, 1, 2, True, False, 2)] == pytest.approx(1.0)
    assert all_reduces[Candidate(16, 1, 1, 1, 2, True, False, 2)] == pytest.approx(0.0, abs=1e-12)
    # Partial sums are held exactly where FSDP2 all-reduces over replicas (the dense units
    # here; Mixtral's experts over EP 8 have none, and its gradients count whole).
    for candidate, fraction in all_reduces.items():
        replicas = fraction > 1e-9 and not candidate.moe
        whole = gradients[candidate]
        assert held[candidate] == (whole // 2 if replicas else whole), candidate
    assert all(held[c] == gradients[c] for c in held if c.fsdp == 1)


def test_a_micro_batch_count_that_does_not_divide_a_ranks_sequences_is_refused(tmp_path, capsys):
    spec = load_model(_config(tmp_path, "mixtral", MIXTRAL))
    cluster = Cluster(hosts=1, per_host=8, accelerator=accelerator("H100"))
    workload = Workload(2048, 2048 * 32)  # 4 sequences per rank at hybrid shard 8
    rejected = check(Candidate(8, accumulation_steps=3), spec, cluster, workload)
    assert isinstance(rejected, Rejected) and rejected.stage == "input"
    assert "gradient_accumulation_steps=3" in rejected.reason and "divisor of 4" in rejected.reason
    config = str(_config(tmp_path, "mixtral", MIXTRAL))
    base = [config, "--seq-len", "2048", "--global-batch-tokens", "65536", "--hosts", "1"]
    assert cli.main([*base, "--limit", "gradient_accumulation_steps=0"]) == 2
    assert "gradient_accumulation_steps" in capsys.readouterr().err
    # A named count is tried as named, never replaced by the fewest that fit.
    p = plan(
        config,
        seq_len=2048,
        global_batch_tokens=2048 * 32,
        hosts=1,
        limits={"gradient_accumulation_steps": (2, 4), "hybrid_shard_degree": (8,)},
    )
    assert {e.candidate.accumulation_steps for e in p.ranked} == {2, 4}
