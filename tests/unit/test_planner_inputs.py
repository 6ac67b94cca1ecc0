"""The planner's answers to inputs that leave it nothing to plan, or that it cannot use: every
one gets a reason, as a rejection or a one-line error, never a silent empty table or a
traceback.
"""

from __future__ import annotations

import argparse
import json
import re

import pytest

from torch_sagemaker.planner import cli, plan

LLAMA_TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


@pytest.fixture
def llama(tmp_path):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA_TINY))
    return path


@pytest.mark.parametrize(
    "limits, stage, named",
    [
        ({"tensor_parallel_degree": (16,)}, "tsm.init", "tensor_parallel_degree=16: must divide"),
        ({"context_parallel_degree": (16,)}, "tsm.init", "context_parallel_degree=16: must divide"),
        ({"expert_parallel_degree": (2,)}, "planner", "has no experts to split"),
        (
            {"activation_offloading": (True,), "activation_checkpointing": (False,)},
            "planner",
            "without activation checkpointing",
        ),
        (
            {"tensor_parallel_degree": (8,), "context_parallel_degree": (8,)},
            "tsm.init",
            "",
        ),
    ],
)
def test_limits_that_exclude_every_candidate_say_why(llama, limits, stage, named):
    result = plan(
        llama, seq_len=512, global_batch_tokens=8 * 512, hosts=1, per_host=8, limits=limits
    )
    assert not result.ranked
    assert result.rejected, "no configuration and no reason"
    assert {r.stage for r in result.rejected} == {stage}
    assert all(named in r.reason for r in result.rejected)


def test_a_limit_value_no_candidate_can_use_is_rejected_beside_the_valid_ones(llama):
    result = plan(
        llama,
        seq_len=512,
        global_batch_tokens=8 * 512,
        hosts=1,
        per_host=8,
        limits={"tensor_parallel_degree": (2, 16), "fsdp": (2,), "activation_offloading": (False,)},
    )
    assert {e.candidate.tensor_parallel_degree for e in result.ranked} == {2}
    sixteen = [r for r in result.rejected if r.candidate.tensor_parallel_degree == 16]
    assert sixteen and all("must divide world_size=8" in r.reason for r in sixteen)
    # Combinations the default ranges make impossible stay out (tp2 with cp8 on 8 ranks).
    assert not [
        r
        for r in result.rejected
        if r.candidate.tensor_parallel_degree == 2 and r.candidate.context_parallel_degree == 8
    ]


def _cli(config, *extra: str) -> list[str]:
    common = ["--seq-len", "512", "--global-batch-tokens", "4Ki", "--hosts", "1"]
    return [
        str(config),
        *common,
        "--limit",
        "fsdp=2",
        "--limit",
        "activation_offloading=false",
        *extra,
    ]


@pytest.mark.parametrize(
    "values, named",
    [
        ({"hidden_size": 4096, "num_attention_heads": 48}, "is not a multiple of the number"),
        ({"hidden_size": "abc"}, "'hidden_size' expected int, got str"),
        ({"hidden_size": -64}, "hidden_size=-64 must be a positive integer"),
        ({"head_dim": 0}, "head_dim=0 must be a positive integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
        # not transformers' pip advice, and no prompt to run an auto_map's code
        ({"model_type": "foo_bar"}, "model_type='foo_bar' is not a family transformers"),
        (
            {"model_type": "foo_bar", "auto_map": {"AutoConfig": "configuration_foo.FooConfig"}},
            "model_type='foo_bar' is not a family transformers",
        ),
    ],
)
def test_inconsistent_config_values_are_one_line_errors(tmp_path, capsys, values, named):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"model_type": "llama", **values}))
    assert cli.main(_cli(path)) == 2
    out, err = capsys.readouterr()
    err = err.strip()
    assert err.startswith(f"planner: model config {str(path)!r}: ") and named in err, err
    assert "\n" not in err and err.endswith("Fix the config.")
    assert not out, out  # nothing on stdout: no prompt, no partial table


@pytest.mark.parametrize("option", ["--json", "--write-config", "--plot"])
def test_output_paths_are_checked_before_the_search(llama, tmp_path, capsys, option):
    for path, named in (
        (tmp_path / "missing" / "out", "the directory"),
        (tmp_path, "it is a directory"),
    ):
        assert cli.main(_cli(llama, option, str(path))) == 2
        out, err = capsys.readouterr()
        assert not out  # refused before the search printed anything
        assert err.startswith(f"planner: cannot write {option} {str(path)!r}: {named}"), err


def test_json_on_stdout_is_all_of_stdout(llama, tmp_path, capsys):
    best, png = tmp_path / "best.json", tmp_path / "memory.png"
    code = cli.main(_cli(llama, "--json", "-", "--write-config", str(best), "--plot", str(png)))
    out, err = capsys.readouterr()
    assert code == 0
    assert json.loads(out)["ranked"]  # nothing after the JSON
    assert f"wrote {best}" in err and f"wrote {png}" in err


@pytest.mark.parametrize(
    "text, count", [("4.1M", 4_100_000), ("0.5Ki", 512), ("1e3", 1000), ("4Mi", 4 * 2**20)]
)
def test_counts_are_read_exactly(text, count):
    assert cli.parse_count(text) == count


@pytest.mark.parametrize(
    "text, named",
    [
        ("1.0001k", "is 1000.1, not a whole count"),
        ("2.5", "not a whole count"),
        ("1e400", "too large"),
    ],
)
def test_counts_that_are_not_whole_are_refused(text, named):
    with pytest.raises(argparse.ArgumentTypeError, match=named):
        cli.parse_count(text)


def test_default_horizons_stop_at_the_layer_count_minus_one(llama):
    # Beyond num_layers - 1 every layer is back on the device: the same configuration.
    from torch_sagemaker.planner.candidates import enumerate_candidates
    from torch_sagemaker.planner.inputs import Cluster, Limits
    from torch_sagemaker.planner.model import load_model
    from torch_sagemaker.planner.presets import accelerator

    spec = load_model(llama)  # 4 layers
    cluster = Cluster(hosts=1, per_host=2, accelerator=accelerator("H100"))
    limits = Limits(allowed={"tensor_parallel_degree": (1,)}, max_horizon=10**6)
    found = {c.horizon for c in enumerate_candidates(spec, cluster, limits) if c.offload}
    assert found == {1, 2, 3}


def test_own_accelerator_figures_take_the_rest_from_the_instance():
    from torch_sagemaker.planner.presets import accelerator

    common = ["x.json", "--seq-len", "4096", "--global-batch-tokens", "64Ki", "--hosts", "1"]
    a100 = accelerator("A100-40GB")
    args = cli.build_parser().parse_args(
        [*common, "--instance", "p4d.24xlarge", "--memory-gib", "48", "--bf16-tflops", "400"]
    )
    own = cli._accelerator(args)
    assert (own.memory_bytes, own.bf16_flops) == (48 * 2**30, 400e12)
    rates = ("memory_bandwidth", "link_rate", "host_rate")
    assert [getattr(own, r) for r in rates] == [getattr(a100, r) for r in rates]
    # One figure alone: the other is the base accelerator's too.
    args = cli.build_parser().parse_args(
        [*common, "--instance", "p4d.24xlarge", "--memory-gib", "48"]
    )
    own = cli._accelerator(args)
    assert (own.memory_bytes, own.bf16_flops, own.fp32_flops) == (
        48 * 2**30,
        a100.bf16_flops,
        a100.fp32_flops,
    )


def test_a_bad_accelerator_figure_is_a_one_line_error(llama, capsys):
    assert cli.main(_cli(llama, "--memory-gib", "-80")) == 2
    assert capsys.readouterr().err.startswith("planner: --memory-gib -80.0: must be a positive")


@pytest.mark.parametrize(
    "argument, named",
    [
        ({"efficiency": "0.5"}, "efficiency='0.5': must be a number"),
        ({"efficiency": None}, "efficiency=None: must be a number"),
        ({"accelerator_name": 42}, "accelerator_name=42: give a preset name"),
        ({"instance_type": 5}, "instance_type=5: give an instance preset name"),
        ({"limits": 5}, "limits=5: give a dict"),
    ],
)
def test_python_api_type_errors_name_the_argument(llama, argument, named):
    with pytest.raises(TypeError, match=re.escape(named)):
        plan(llama, seq_len=512, global_batch_tokens=4096, hosts=1, **argument)


def _written_by_transformers(tmp_path, config):
    """``config`` as a checkpoint holds it: written by transformers' own writer."""
    path = tmp_path / "config.json"
    config.to_json_file(str(path))
    return path


_TEXT_SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}


def test_a_config_transformers_wrote_with_an_infinite_value_loads(tmp_path):
    # transformers writes an infinite float as {"__float__": "Infinity"} (Bamba's, Falcon-H1's,
    # Nemotron-H's time_step_limit); only its own reader turns that back into a float.
    import math

    import transformers

    from torch_sagemaker.planner.model import load_model

    config = transformers.BambaConfig(
        **_TEXT_SIZES, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, attn_layer_indices=[1]
    )
    assert config.time_step_limit[1] == math.inf
    spec = load_model(_written_by_transformers(tmp_path, config))
    assert spec.name == "BambaForCausalLM"
    assert tuple(spec.config.time_step_limit) == (0.0, math.inf)


def test_an_image_text_checkpoints_config_is_planned_as_its_causal_lm(tmp_path):
    # A Qwen 3.5 checkpoint's config.json is the image-text config, architecture
    # Qwen3_5ForConditionalGeneration; its causal LM is built from the text config, as
    # AutoModelForCausalLM.from_config builds it.
    import torch
    import transformers

    from torch_sagemaker.planner.model import load_model

    config = transformers.Qwen3_5Config(
        text_config={**_TEXT_SIZES, "head_dim": 16},
        vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64},
        architectures=["Qwen3_5ForConditionalGeneration"],
    )
    spec = load_model(_written_by_transformers(tmp_path, config))
    assert spec.name == "Qwen3_5ForCausalLM"
    with torch.device("meta"):
        direct = transformers.Qwen3_5ForCausalLM(config.text_config)
    assert spec.num_params == sum(p.numel() for p in direct.parameters())
    assert spec.num_layers == 2 and spec.dim("hidden_size") == 64


def _per_layer_config(name: str, **sizes):
    """A small text config of ``name`` with per-layer input embeddings."""
    import transformers

    return getattr(transformers, name)(
        **{**_TEXT_SIZES, **sizes},
        head_dim=16,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256,
    )


def _gemma4_text():
    # Its full-attention layer (the sixth) gets global_head_dim: a per-layer override.
    return _per_layer_config("Gemma4TextConfig", num_hidden_layers=6, global_head_dim=32)


def _gemma3n_text():
    return _per_layer_config(
        "Gemma3nTextConfig", intermediate_size=[128, 256], num_kv_shared_layers=0
    )


@pytest.mark.parametrize(
    "make, named",
    [
        (_gemma4_text, "Gemma4TextConfig sets head_dim (16 or 32) per layer (per_layer_config)"),
        (
            _gemma3n_text,
            "Gemma3nTextConfig gives intermediate_size as a list, one per layer (128 or 256)",
        ),
    ],
)
def test_sizes_given_per_layer_are_one_line_refusals_naming_them(tmp_path, capsys, make, named):
    # Note [One size per layer]: any one value would size every layer wrongly.
    path = _written_by_transformers(tmp_path, make())
    assert cli.main(_cli(path)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"planner: model config {str(path)!r}: ") and named in err, err
    assert "\n" not in err and "Note [One size per layer]" in err, err
