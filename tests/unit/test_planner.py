"""The parallelism planner (torch_sagemaker/planner): its verdicts are the library's, its output
is accepted by tsm.init, its arithmetic is FSDP's, and its command line writes what it says.

The memory model against live tensors is tests/distributed/test_planner_memory.py; the time
model against recorded measurements is tests/unit/test_planner_time.py.
"""

from __future__ import annotations

import json

import pytest

from torch_sagemaker import _init, _transform
from torch_sagemaker.config import ConfigError
from torch_sagemaker.moe.moe_config import MoEConfig
from torch_sagemaker.planner import Limits, cli, plan, report
from torch_sagemaker.planner.candidates import Candidate, Checked, Rejected, check
from torch_sagemaker.planner.inputs import Cluster, Workload
from torch_sagemaker.planner.model import load_model
from torch_sagemaker.planner.presets import accelerator
from torch_sagemaker.planner.shards import _flat_layout, chunk

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
}
QWEN2_SMALL = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def _write(tmp_path, name, config):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("configs")
    return {
        "llama70b": plan(
            _write(tmp, "llama70b", LLAMA_70B),
            seq_len=4096,
            global_batch_tokens=4 * 2**20,
            hosts=32,
            instance_type="p5.48xlarge",
            limits={
                "tensor_parallel_degree": (1, 8),
                "context_parallel_degree": (1,),
                "hybrid_shard_degree": (8, 32, 64, 256),
                "activation_loading_horizon": (2,),
            },
        ),
        "mixtral": plan(
            _write(tmp, "mixtral", MIXTRAL),
            seq_len=2048,
            global_batch_tokens=2048 * 64,
            hosts=2,
            instance_type="p4de.24xlarge",
            limits={
                "context_parallel_degree": (1,),
                "hybrid_shard_degree": (2, 4, 8, 16),
                "activation_offloading": (False,),
            },
        ),
        "qwen2": plan(
            _write(tmp, "qwen2", QWEN2_SMALL),
            seq_len=8192,
            global_batch_tokens=8192 * 16,
            hosts=1,
            accelerator_name="A100-40GB",
            limits={"activation_loading_horizon": (1, 2), "context_parallel_degree": (1, 2)},
        ),
    }


def test_tsm_init_accepts_the_top_five_of_every_plan(plans, tmp_path):
    for name, p in plans.items():
        top = p.fitting[:5]
        assert len(top) == 5, name
        for i, e in enumerate(top):
            path = tmp_path / f"{name}_{i}.json"
            report.write_smp_config(e, path)
            cfg, sharding = _init.dry_run(
                str(path),
                world_size=p.cluster.world_size,
                ranks_per_host=p.cluster.per_host,
                environ={},
            )
            smp = e.candidate.smp_config()
            assert cfg.tensor_parallel_degree == smp["tensor_parallel_degree"]
            assert cfg.sm_activation_offloading == smp["sm_activation_offloading"]
            assert sharding.layout == e.checked.plan.layout
            # And the model half: what tsm.transform checks before it changes anything.
            _transform.check_model_config(
                p.model.policy,
                p.model.config,
                tp=cfg.tensor_parallel_degree,
                cp=cfg.context_parallel_degree,
                ep=cfg.expert_parallel_degree,
                config=MoEConfig() if e.candidate.moe else None,
            )


def test_the_plans_rank_fitting_configurations_by_speed(plans):
    for p in plans.values():
        fitting = p.fitting
        assert fitting and p.best is fitting[0]
        speeds = [e.time.tokens_per_second for e in fitting]
        assert speeds[0] >= 0.999 * max(speeds)
        assert all(e.memory.peak <= p.cluster.memory_budget for e in fitting)
        assert all(not e.fits for e in p.ranked[len(fitting) :])


def test_the_70b_example_picks_what_smp_publishes(plans):
    # SMP's best practices and the HyperPod recipe run Llama 70B on 256 GPUs with every rank
    # in one shard group, no TP, checkpointing (reference/smp_api.md section 4).
    best = plans["llama70b"].best
    assert best.candidate.smp_config()["hybrid_shard_degree"] == 256
    assert best.candidate.tensor_parallel_degree == 1 and best.candidate.checkpointing


def test_invalid_configurations_carry_the_librarys_message(plans):
    spec = plans["mixtral"].model
    cluster = plans["mixtral"].cluster
    workload = plans["mixtral"].workload
    # TP that does not divide the heads: tsm.transform's own message.
    rejected = check(Candidate(0, tensor_parallel_degree=16), spec, cluster, workload)
    assert isinstance(rejected, Rejected) and rejected.stage == "tsm.transform"
    with pytest.raises(ValueError) as raised:
        _transform.check_model_config(spec.policy, spec.config, tp=16, cp=1, ep=1)
    assert rejected.reason == str(raised.value)
    # EP with TP: tsm.init's message (sharding_plan.combination_problems).
    rejected = check(
        Candidate(2, tensor_parallel_degree=2, expert_parallel_degree=2, moe=True),
        spec,
        cluster,
        workload,
    )
    assert isinstance(rejected, Rejected) and rejected.stage == "tsm.init"
    with pytest.raises(ConfigError) as init_error:
        _init.dry_run(
            {"tensor_parallel_degree": 2, "expert_parallel_degree": 2, "hybrid_shard_degree": 2},
            world_size=16,
            environ={},
        )
    assert rejected.reason == "; ".join(init_error.value.problems)
    # EP that does not divide the experts.
    assert isinstance(
        check(Candidate(1, expert_parallel_degree=16, moe=True), spec, cluster, workload),
        Rejected,
    )
    # A batch that does not split over the data-parallel ranks.
    small = Workload(2048, 2048 * 3, "bfloat16")
    rejected = check(Candidate(16), spec, cluster, small)
    assert isinstance(rejected, Rejected) and "does not split" in rejected.reason
    assert isinstance(check(Candidate(16), spec, cluster, workload), Checked)
    # Every plan lists what it rejected, with reasons.
    assert all(r.reason for p in plans.values() for r in p.rejected)
    assert any(r.stage == "tsm.init" for r in plans["llama70b"].rejected)


def test_sliding_window_with_cp_is_refused_as_transform_refuses_it(tmp_path):
    config = dict(QWEN2_SMALL, use_sliding_window=True, sliding_window=4096)
    spec = load_model(_write(tmp_path, "swa", config))
    cluster = Cluster(hosts=1, per_host=8, accelerator=accelerator("H100"))
    got = check(Candidate(8, context_parallel_degree=2), spec, cluster, Workload(4096, 4096 * 4))
    if getattr(spec.config, "sliding_window", None) is None:
        pytest.skip("this transformers drops sliding_window when use_sliding_window is off")
    assert isinstance(got, Rejected) and "sliding-window" in got.reason


def test_chunks_and_fsdp1_padding_by_hand():
    # torch.chunk: ceil-sized chunks, the last ones short or empty.
    assert [chunk(10, 4, i) for i in range(4)] == [3, 3, 3, 1]
    assert [chunk(2, 4, i) for i in range(4)] == [1, 1, 0, 0]
    # FSDP1 aligns each parameter to 16 bytes (4 fp32 elements) and pads to the group size.
    offsets, total = _flat_layout([(3,), (5,), (2, 2)], align=4, pad_to=8)
    assert offsets == [0, 4, 12] and total == 16
    offsets, total = _flat_layout([(3,), (5,)], align=4, pad_to=3)
    assert offsets == [0, 4] and total == 9


def test_limits_are_obeyed_and_checked():
    with pytest.raises(ValueError, match="unknown settings"):
        Limits(allowed={"pipeline_parallel_degree": (2,)})
    with pytest.raises(ValueError, match="at least 1"):
        Workload(0, 10)
    with pytest.raises(ValueError, match="multiple of 4096"):
        Workload(4096, 5000)


@pytest.mark.parametrize(
    "name, values, named",
    [
        ("fsdp", (3,), "3 is not one of the values fsdp takes (1 or 2)"),
        ("activation_checkpointing", ("no",), "'no' is not one of the values"),
        ("activation_offloading", (1,), "(True or False)"),
        ("tensor_parallel_degree", 2, "(got int)"),
        ("tensor_parallel_degree", "24", "(got str)"),
        ("tensor_parallel_degree", (True,), "True is not one of the values"),
        ("context_parallel_degree", (0,), "(integers >= 1)"),
        ("hybrid_shard_degree", (-1,), "(integers >= 0)"),
        ("activation_loading_horizon", (1.5,), "1.5 is not one of the values"),
        ("moe", (), "at least one value"),
    ],
)
def test_limits_check_their_values(tmp_path, capsys, name, values, named):
    with pytest.raises(ValueError, match=f"limit {name}=") as raised:
        Limits(allowed={name: values})
    assert named in str(raised.value), raised.value
    config = _write(tmp_path, "qwen2", QWEN2_SMALL)
    with pytest.raises(ValueError, match=f"limit {name}="):
        plan(config, seq_len=1024, global_batch_tokens=8192, hosts=1, limits={name: values})


def test_limits_are_kept_as_tuples_and_the_command_line_refuses_bad_ones(tmp_path, capsys):
    limits = Limits(allowed={"tensor_parallel_degree": [1, 2, 2], "moe": {False}})
    assert limits.allowed == {"tensor_parallel_degree": (1, 2), "moe": (False,)}
    assert Limits(allowed={"hybrid_shard_degree": range(0, 2)}).allowed == {
        "hybrid_shard_degree": (0, 1)
    }
    config = str(_write(tmp_path, "qwen2", QWEN2_SMALL))
    common = ["--seq-len", "1024", "--global-batch-tokens", "8Ki", "--hosts", "1"]
    for bad in ("fsdp=3", "activation_checkpointing=1", "tensor_parallel_degree=0"):
        assert cli.main([config, *common, "--limit", bad]) == 2, bad
        assert f"limit {bad.partition('=')[0]}=" in capsys.readouterr().err


def test_a_horizon_limit_names_the_horizons_tried_beyond_max_horizon(tmp_path, capsys):
    from torch_sagemaker.planner.candidates import enumerate_candidates

    spec = load_model(_write(tmp_path, "qwen2", QWEN2_SMALL))
    cluster = Cluster(hosts=1, per_host=8, accelerator=accelerator("H100"))
    fixed = {"tensor_parallel_degree": (1,), "context_parallel_degree": (1,)}

    def horizons(limits):
        return sorted({c.horizon for c in enumerate_candidates(spec, cluster, limits) if c.offload})

    assert horizons(Limits(allowed=fixed)) == [1, 2, 3, 4]  # 1 to max_horizon by default
    assert horizons(Limits(allowed=fixed, max_horizon=2)) == [1, 2]
    named = {**fixed, "activation_loading_horizon": (2, 6)}
    assert horizons(Limits(allowed=named)) == [2, 6]  # 6 > max_horizon=4: tried all the same
    assert horizons(Limits(allowed=named, max_horizon=1)) == [2, 6]
    # And through the command line: the horizon-6 configurations are ranked.
    argv = [str(_write(tmp_path, "q", QWEN2_SMALL)), "--seq-len", "4096"]
    argv += ["--global-batch-tokens", "32Ki", "--hosts", "1", "--json", "-"]
    argv += ["--limit", "tensor_parallel_degree=1", "--limit", "context_parallel_degree=1"]
    argv += ["--limit", "activation_offloading=true", "--limit", "activation_loading_horizon=6"]
    assert cli.main(argv) in (0, 1)
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and {r["smp_config"]["activation_loading_horizon"] for r in ranked} == {6}


def test_the_rejection_summary_gives_one_example_of_every_rule():
    # docs/planner.md: "the table lists one example per rule". Mixtral on 2 x p4de.24xlarge
    # meets nine rules; the summary once stopped at eight.
    from types import SimpleNamespace

    rejected = [
        Rejected(Candidate(k), "tsm.init", f"rule {chr(ord('a') + k)}: degree {n}")
        for k in range(12)
        for n in range(k + 1)
    ]
    text = report.rejected_summary(SimpleNamespace(rejected=rejected))
    lines = text.splitlines()
    assert lines[0].startswith("78 invalid (78 at tsm.init); one example of each rule")
    assert len(lines) == 1 + 12
    assert lines[1].startswith("- 12 like hsd11 ") and lines[-1].startswith("- 1 like hsd0 ")
    assert all(f"rule {chr(ord('a') + k)}: degree 0" in text for k in range(12))


def test_optimizer_time_under_expert_parallelism_counts_the_experts_shard(tmp_path):
    # Mixtral-shaped, 16 ranks, hybrid_shard_degree=0, EP 8: the dense units shard over all
    # 16 ranks, each rank's one expert per layer over the 2 ranks that hold it. FSDP1 gives
    # each of them half of the flat experts; FSDP2 cuts the expert dim (1 row) in 1-row chunks,
    # so rank 0 holds all of it. The time model once divided the experts by 16 as well.
    h, inter, layers, vocab = 1024, 3584, 8, 32000
    dense = 2 * vocab * h + h + layers * (2 * h * h + 2 * 256 * h + 2 * h + 8 * h)
    experts_per_rank = layers * 3 * h * inter  # one expert of each layer
    p = plan(
        _write(tmp_path, "mixtral", MIXTRAL),
        seq_len=2048,
        global_batch_tokens=2048 * 64,
        hosts=2,
        instance_type="p4de.24xlarge",
        limits={
            "hybrid_shard_degree": (0,),
            "expert_parallel_degree": (8,),
            "tensor_parallel_degree": (1,),
            "context_parallel_degree": (1,),
            "moe": (True,),
            "activation_offloading": (False,),
            "activation_checkpointing": (True,),
        },
    )
    per_element = p.machine.optimizer_seconds
    got = {e.candidate.fsdp: e.time.optimizer for e in p.ranked}
    assert got[1] == pytest.approx((dense / 16 + experts_per_rank / 2) * per_element, rel=1e-3)
    assert got[2] == pytest.approx((dense / 16 + experts_per_rank) * per_element, rel=1e-3)
    # Without an MoEConfig the experts are one (8, ...) weight of each layer unit: FSDP1
    # flattens the unit and shards it evenly over the 16 ranks, FSDP2 cuts dim 0 into 1-row
    # chunks, so ranks 0-7 hold one expert each (and the others none).
    dense_plan = plan(
        p.model,
        seq_len=2048,
        global_batch_tokens=2048 * 64,
        hosts=2,
        instance_type="p4de.24xlarge",
        limits={
            "hybrid_shard_degree": (16,),
            "tensor_parallel_degree": (1,),
            "context_parallel_degree": (1,),
            "moe": (False,),
            "activation_offloading": (False,),
            "activation_checkpointing": (True,),
        },
    )
    got = {e.candidate.fsdp: e.time.optimizer for e in dense_plan.ranked}
    all_experts = 8 * experts_per_rank
    assert got[1] == pytest.approx((dense + all_experts) / 16 * per_element, rel=1e-3)
    assert got[2] == pytest.approx((dense / 16 + all_experts / 8) * per_element, rel=1e-3)


def test_command_line_writes_the_best_config_json_and_plot(tmp_path, capsys):
    config = _write(tmp_path, "qwen2", QWEN2_SMALL)
    best, out_json, png = tmp_path / "best.json", tmp_path / "plan.json", tmp_path / "mem.png"
    code = cli.main(
        [
            str(config),
            "--seq-len",
            "4096",
            "--global-batch-tokens",
            "64Ki",
            "--hosts",
            "1",
            "--accelerator",
            "A100-80GB",
            "--limit",
            "tensor_parallel_degree=1,2",
            "--limit",
            "context_parallel_degree=1",
            "--limit",
            "activation_offloading=false",
            "--write-config",
            str(best),
            "--json",
            str(out_json),
            "--plot",
            str(png),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert "| 1 | " in text and "invalid" in text
    written = json.loads(best.read_text())
    data = json.loads(out_json.read_text())
    assert written == data["ranked"][0]["smp_config"]
    assert all(r["smp_config"]["tensor_parallel_degree"] in (1, 2) for r in data["ranked"])
    assert not any(r["smp_config"]["sm_activation_offloading"] for r in data["ranked"])
    assert data["invalid"] and all(r["reason"] for r in data["invalid"])
    assert png.stat().st_size > 0
    _init.dry_run(str(best), world_size=8, environ={})


@pytest.mark.parametrize(
    "world_size, ranks_per_host, message",
    [
        (0, None, r"dry_run\(world_size=0\): must be in \[1, 2\*\*31 - 1\]"),
        (10**30, None, r"dry_run\(world_size=10{30}\): must be in"),
        (8, 16, r"dry_run\(ranks_per_host=16\): must be at most world_size=8"),
    ],
)
@pytest.mark.timeout(10)  # a degree not dividing a huge world listed its divisors for hours
def test_dry_run_refuses_a_world_out_of_range(world_size, ranks_per_host, message):
    with pytest.raises(ValueError, match=message):
        _init.dry_run(
            {"tensor_parallel_degree": 3},
            world_size=world_size,
            ranks_per_host=ranks_per_host,
            environ={},
        )


def test_command_line_refuses_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main([str(tmp_path / "x.json"), "--seq-len", "4096"])  # missing arguments
    capsys.readouterr()
    common = ["--seq-len", "1024", "--global-batch-tokens", "8Ki", "--hosts", "1"]
    assert cli.main([str(tmp_path / "missing.json"), *common]) == 2
    assert "cannot read model config" in capsys.readouterr().err
    # no ActivationProfile, and the probe cannot measure one (tests/unit/test_planner_probe.py)
    no_profile = {"model_type": "diffllama", "hidden_size": 128, "intermediate_size": 256}
    no_profile.update(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
    assert cli.main([str(_write(tmp_path, "diffllama", no_profile)), *common]) == 2
    assert "measuring it on a reduced model failed" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown accelerator"):
        accelerator("V100")


def _exit_code(argv: list[str]) -> int | str | None:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse refuses what its type converters refuse
        return e.code


@pytest.mark.parametrize(
    "bad, named",
    [
        (["--hosts", "0"], "hosts=0"),
        (["--seq-len", "infk"], "'infk' is not a count"),
        (["--global-batch-tokens", "1e400k"], "'1e400k' is too large a count"),
        (["--seq-len", "nanM"], "'nanM' is not a count"),
        (["--memory-gib", "inf", "--bf16-tflops", "100"], "--memory-gib inf"),
        (["--memory-gib", "nan", "--bf16-tflops", "100"], "--memory-gib nan"),
        (["--memory-gib", "-80", "--bf16-tflops", "100"], "--memory-gib -80"),
        (["--memory-gib", "80", "--bf16-tflops", "0"], "--bf16-tflops 0"),
        (["--memory-gib", "80", "--bf16-tflops", "-5"], "--bf16-tflops -5"),
        (["--memory-gib", "80", "--bf16-tflops", "1e300"], "bf16_flops=inf"),
        (["--per-host", "0"], "per_host (accelerators per host)=0"),
        (["--nics", "0"], "nics=0"),
        (["--nics", "-2"], "nics=-2"),
        (["--top", "-1"], "--top -1"),
        (["--max-horizon", "0"], "max_horizon=0"),
        (["--efficiency", "0"], "efficiency=0"),
        (["--usable-memory", "inf"], "usable_memory=inf"),
        (["--nic-rate", "inf"], "nic_bits (NIC rate)=inf"),
    ],
)
def test_command_line_refuses_absurd_numbers_as_it_refuses_hosts_0(tmp_path, capsys, bad, named):
    # Each gives exit status 2 and one line naming the value, never a traceback, and none is
    # silently replaced by a default.
    config = str(_write(tmp_path, "qwen2", QWEN2_SMALL))
    argv = [config, "--seq-len", "4096", "--global-batch-tokens", "64Ki", "--hosts", "1"]
    argv += ["--limit", "tensor_parallel_degree=1", "--limit", "context_parallel_degree=1"]
    argv += ["--limit", "activation_offloading=false", "--limit", "hybrid_shard_degree=8"]
    assert _exit_code([*argv, *bad]) == 2
    err = capsys.readouterr().err
    assert named in err, err
    assert "Traceback" not in err


def test_an_accelerator_without_memory_or_flops_is_refused():
    from torch_sagemaker.planner.presets import Accelerator

    with pytest.raises(ValueError, match="bf16_flops=0"):
        Accelerator("x", 80 << 30, 0.0, 1e12, 1e12, 1e11)
    with pytest.raises(ValueError, match="memory_bytes=-1"):
        Accelerator("x", -1, 1e12, 1e12, 1e12, 1e11)
    with pytest.raises(ValueError, match="memory_bandwidth=inf"):
        Accelerator("x", 80 << 30, 1e12, 1e12, float("inf"), 1e11)
    Accelerator("cpu", 1 << 40, 1.0, 1.0, 1.0, 0.0)  # no links between ranks: allowed


def test_published_configurations_are_valid_and_fit():
    from benchmarks.planner import public_configs

    rows = public_configs.evaluate_all()
    assert len(rows) == len(public_configs.CONFIGS) >= 7
    for r in rows:
        assert r.valid, f"{r.config.name}: {r.reason}"
        assert r.fits and r.peak <= r.budget, (r.config.name, r.peak, r.budget)
        assert r.step > 0
    table = public_configs.table(rows)
    assert table.count("| yes |") == len(rows)


def test_saved_activations_count_a_reused_address_once(monkeypatch):
    # FSDP frees an unsharded parameter's storage after its unit's forward and the allocator
    # may hand the address to a new activation, which later ops save several times (as views):
    # it must count once, the freed one as nothing.
    import torch

    from benchmarks.planner import measure

    counter = measure.SavedActivations(torch.nn.Linear(2, 2))
    freed = torch.ones(64)
    reused = torch.ones(4, 32)
    gate, up = reused.chunk(2, dim=-1)
    with monkeypatch.context() as patch:
        patch.setattr(measure, "_key", lambda t: ("cpu", 1))  # every storage at one address
        counter._record(freed)
        freed.untyped_storage().resize_(0)
        counter._record(gate)
        counter._record(up)
    assert len(counter.storages) == 2
    assert sum(s.nbytes() for s in counter.storages.values()) == 4 * 32 * 4


def test_a_tied_head_is_counted_once_under_tp_with_both_fsdp_versions(tmp_path):
    # Note [Tied parameters count once]: FSDP1 under TP keeps the tie (one flat-parameter
    # slot), as FSDP2 does, so the tied model holds exactly one head less than the untied one.
    from torch_sagemaker.planner.memory import sharding
    from torch_sagemaker.planner.shards import state_bytes

    cluster = Cluster(hosts=1, per_host=2, accelerator=accelerator("H100"))
    workload = Workload(1024, 1024 * 2)
    small = dict(QWEN2_SMALL, num_hidden_layers=2)
    tied = load_model(_write(tmp_path, "tied", small))
    untied = load_model(_write(tmp_path, "untied", dict(small, tie_word_embeddings=False)))
    head = QWEN2_SMALL["vocab_size"] // 2 * QWEN2_SMALL["hidden_size"]  # vocabulary over tp 2
    for fsdp in (1, 2):
        candidate = Candidate(1, tensor_parallel_degree=2, fsdp=fsdp)
        counted = []
        for spec in (tied, untied):
            checked = check(candidate, spec, cluster, workload)
            assert isinstance(checked, Checked), (fsdp, checked)
            counted.append(state_bytes(spec, sharding(spec, checked, workload)))
        one, two = counted
        assert two.parameters - one.parameters == head * 4, fsdp
        assert two.gradients - one.gradients == head * 4, fsdp
        assert two.optimizer - one.optimizer == 2 * head * 4 + 4, fsdp  # moments and step


def test_fsdp2_over_a_shard_group_of_one_rank_holds_unsharded_buffers(tmp_path):
    # FSDP2 with hybrid_shard_degree=1 still copies each unit's shard into a separate
    # unsharded parameter (the root's stays from forward to backward) and passes gradients
    # through its reduce-scatter buffers; only its prefetch allocates nothing there. FSDP1
    # over one rank is NO_SHARD and, in fp32, computes in its flat parameter: no buffer.
    from torch_sagemaker.planner import memory

    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 2048,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,  # as measured: the benchmark's tiny config widened after its heads
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    spec = load_model(_write(tmp_path, "llama_tiny", llama))
    root = 2 * 256 * 512 + 512  # embedding, head, final norm
    layer = 4 * 64 * 512 + 3 * 512 * 2048 + 2 * 512  # attention, MLP, norms
    cluster = Cluster(hosts=1, per_host=2, accelerator=accelerator("H100"))
    workload = Workload(8, 16, "float32")
    estimates = {}
    for hsd, fsdp in ((1, 2), (1, 1), (2, 2)):
        checked = check(Candidate(hsd, fsdp=fsdp), spec, cluster, workload)
        assert isinstance(checked, Checked), checked
        estimates[hsd, fsdp] = memory.estimate(spec, checked, workload)
    assert estimates[1, 2].buffers == (root + layer + layer) * 4
    assert estimates[2, 2].buffers == (root + 2 * layer + layer) * 4
    assert estimates[1, 1].buffers == 0
    # Two CPU ranks training this model (sequence 8, one per rank, checkpointing), step 2:
    # the peak of the allocations a TorchDispatchMode saw over the census of the model state.
    measured = 240_932_684
    assert abs(estimates[1, 2].peak - measured) < 0.02 * measured, estimates[1, 2]


def test_a_tied_parameter_is_split_where_any_of_its_names_is_split(tmp_path):
    # BERT tied: cls.predictions.bias is the decoder's bias, which the head splits over the
    # vocabulary; tsm.transform splits it there (Note [Tied parameters of parameter holders]).
    bert = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 128}
    spec = load_model(_write(tmp_path, "bert", dict(bert, num_attention_heads=4)))
    styles = {p.name: p.style for p in spec.params}
    assert spec.params[[p.name for p in spec.params].index("cls.predictions.decoder.bias")].tied_to
    assert styles["cls.predictions.bias"] == styles["cls.predictions.decoder.bias"] is not None
