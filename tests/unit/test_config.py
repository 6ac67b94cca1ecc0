"""SMPConfig loading and validation: every rule, its message, and the source precedence."""

import json
from types import SimpleNamespace

import pytest

from torch_sagemaker.config import ENV_VAR, ConfigError, SMPConfig, load, load_raw, validate


def problems(raw, world_size=None):
    with pytest.raises(ConfigError) as info:
        validate(raw, world_size)
    assert isinstance(info.value, ValueError)
    return info.value.problems


def test_defaults_are_smp_documented():
    cfg = validate({}, world_size=8)
    assert cfg == SMPConfig()
    assert (
        cfg.hybrid_shard_degree,
        cfg.sm_activation_offloading,
        cfg.activation_loading_horizon,
        cfg.fsdp_cache_flush_warnings,
        cfg.allow_empty_shards,
        cfg.tensor_parallel_degree,
        cfg.context_parallel_degree,
        cfg.expert_parallel_degree,
    ) == (0, True, 2, True, False, 1, 1, 1)
    with pytest.raises(AttributeError):
        cfg.tensor_parallel_degree = 2  # frozen


def test_valid_config_round_trips():
    raw = {
        "hybrid_shard_degree": 2,
        "tensor_parallel_degree": 2,
        "random_seed": 7,
        "sm_activation_offloading": False,
        "activation_loading_horizon": 3,
    }
    assert validate(raw, world_size=8).to_dict() == {**SMPConfig().to_dict(), **raw}


def test_unknown_key_did_you_mean():
    (p,) = problems({"tensor_paralel_degree": 2})
    assert (
        "unknown key 'tensor_paralel_degree'" in p and "did you mean 'tensor_parallel_degree'" in p
    )


def test_unknown_key_renamed_and_v1_and_unrelated():
    ps = problems({"tensor_parallel_seed": 0, "partitions": 2, "zzz": 1})
    assert any("'tensor_parallel_seed'" in p and "'random_seed'" in p for p in ps)
    assert any("'partitions'" in p and "SMP v1" in p for p in ps)
    assert any("'zzz'" in p and "valid keys are" in p for p in ps)


def test_sdk_added_placement_strategy_is_ignored(monkeypatch):
    """SageMaker's SDK puts {"placement_strategy": "cluster"} in SM_HP_MP_PARAMETERS for GPU
    training recipes; SMP v2 jobs started that way must not fail in tsm.init."""
    logged = []
    logger = SimpleNamespace(info=logged.append)
    monkeypatch.setattr("torch_sagemaker.config.get_logger", lambda: logger)
    raw = load_raw(None, environ={ENV_VAR: json.dumps({"placement_strategy": "cluster"})})
    cfg = validate({**raw, "hybrid_shard_degree": 2}, world_size=4)
    assert cfg == SMPConfig(hybrid_shard_degree=2)
    assert len(logged) == 1 and "ignoring placement_strategy='cluster'" in logged[0]


def test_fp8_keys_point_to_fp8_autocast():
    """SMP v2 has no FP8 config key; scripts' and recipes' FP8 switches say where FP8 is."""
    ps = problems({"fp8": True, "fp8_amax_history_len": 1024})
    assert len(ps) == 2 and all("no config key for FP8" in p and "fp8_autocast" in p for p in ps)


def test_bool_is_not_an_int():
    (p,) = problems({"tensor_parallel_degree": True})
    assert "tensor_parallel_degree=True" in p and "booleans are not integers" in p


@pytest.mark.parametrize(
    "key,value",
    [("hybrid_shard_degree", 2.0), ("random_seed", "1"), ("activation_loading_horizon", None)],
)
def test_wrong_int_types(key, value):
    (p,) = problems({key: value})
    assert f"{key}={value!r}" in p and "must be an integer" in p


@pytest.mark.parametrize(
    "key", ["sm_activation_offloading", "fsdp_cache_flush_warnings", "allow_empty_shards"]
)
def test_wrong_bool_types(key):
    (p,) = problems({key: 1})
    assert f"{key}=1" in p and "must be a boolean" in p


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("tensor_parallel_degree", 0, "must be >= 1"),
        ("context_parallel_degree", -1, "must be >= 1"),
        ("expert_parallel_degree", 0, "must be >= 1"),
        ("hybrid_shard_degree", -2, "must be >= 0"),
        ("activation_loading_horizon", 0, "must be >= 1"),
        ("random_seed", -1, "must be in [0, 2**63 - 1]"),
    ],
)
def test_out_of_range(key, value, fragment):
    (p,) = problems({key: value}, world_size=8)
    assert f"{key}={value}" in p and fragment in p


@pytest.mark.parametrize(
    "key", ["tensor_parallel_degree", "context_parallel_degree", "expert_parallel_degree"]
)
def test_degree_must_divide_world(key):
    ps = problems({key: 3}, world_size=8)
    assert any(f"{key}=3: must divide world_size=8" in p and "1, 2, 4, 8" in p for p in ps)


@pytest.mark.timeout(10)  # listing the divisors by trying every number up to it took minutes
def test_divisors_of_the_largest_world_are_listed_at_once():
    (p,) = problems({"tensor_parallel_degree": 2}, world_size=2**31 - 1)
    assert p.endswith("Use one of 1, 2147483647.")
    (p,) = problems({"tensor_parallel_degree": 5}, world_size=36)
    assert p.endswith("Use one of 1, 2, 3, 4, 6, 9, 12, 18, 36.")


@pytest.mark.parametrize("world_size", [0, 2**31, 10**30])
def test_world_size_out_of_range_is_the_callers_error(world_size):
    with pytest.raises(ValueError, match=r"world_size=.*: must be in \[1, 2\*\*31 - 1\]"):
        validate({}, world_size)


def test_hybrid_shard_degree_rules():
    (p,) = problems({"hybrid_shard_degree": 3}, world_size=8)
    assert (
        "world_size % (hybrid_shard_degree * tensor_parallel_degree * expert_parallel_degree)" in p
    )
    assert "8 % (3 * 1 * 1) = 2" in p and "Use one of 1, 2, 4, 8" in p
    (p,) = problems({"hybrid_shard_degree": 8, "tensor_parallel_degree": 2}, world_size=8)
    assert "must be at most" in p and "= 4" in p
    validate({"hybrid_shard_degree": 3, "tensor_parallel_degree": 2}, world_size=12)


def test_context_parallel_within_shard_group():
    (p,) = problems({"context_parallel_degree": 4, "hybrid_shard_degree": 2}, world_size=8)
    assert (
        "context_parallel_degree=4 > hybrid_shard_degree=2" in p
        and "Raise hybrid_shard_degree" in p
    )
    (p,) = problems({"context_parallel_degree": 2, "hybrid_shard_degree": 1}, world_size=8)
    assert "context_parallel_degree=2 > hybrid_shard_degree=1" in p
    (p,) = problems({"context_parallel_degree": 2, "hybrid_shard_degree": 3}, world_size=6)
    assert "must divide the shard degree 3" in p
    # 0 resolves to the largest degree, which may hold cp.
    assert validate({"context_parallel_degree": 2}, world_size=8).context_parallel_degree == 2


def test_expert_with_tensor_parallel_is_refused():
    ps = problems({"expert_parallel_degree": 2, "tensor_parallel_degree": 2}, world_size=8)
    assert any("not compatible with tensor parallelism" in p for p in ps)


def test_every_problem_reported_at_once():
    ps = problems(
        {
            "tensor_parallel_degree": 3,
            "sm_activation_offloading": "yes",
            "bogus": 1,
            "activation_loading_horizon": 0,
        },
        world_size=8,
    )
    assert len(ps) == 4, ps
    joined = "\n".join(ps)
    for fragment in ("'bogus'", "sm_activation_offloading='yes'", "activation_loading_horizon=0"):
        assert fragment in joined


def test_world_checks_skipped_without_world_size():
    assert validate({"tensor_parallel_degree": 3}).tensor_parallel_degree == 3


# ---------------------------------------------------------------- sources and precedence


def test_dict_file_and_env_precedence(tmp_path):
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}))
    env = {ENV_VAR: json.dumps({"hybrid_shard_degree": 4})}
    raw = load_raw(str(path), environ=env)
    assert raw == {"tensor_parallel_degree": 2, "hybrid_shard_degree": 4}  # env wins
    assert load({"random_seed": 3}, environ={}).random_seed == 3
    # Pre-init assignments on tsm.state win over the environment.
    assert load_raw(None, environ=env, overrides={"hybrid_shard_degree": 1}) == {
        "hybrid_shard_degree": 1
    }
    assert load(path, environ={}, world_size=8).tensor_parallel_degree == 2  # PathLike accepted


def test_empty_env_value_is_ignored():
    assert load_raw({"random_seed": 1}, environ={ENV_VAR: "  "}) == {"random_seed": 1}


def test_malformed_json_file_names_source_and_position(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "tensor_parallel_degree": 2,\n}\n')
    with pytest.raises(ConfigError) as info:
        load_raw(str(path), environ={})
    message = str(info.value)
    assert str(path) in message and "line 3, column 1" in message


def test_malformed_env_names_variable_and_position():
    with pytest.raises(ConfigError) as info:
        load_raw(None, environ={ENV_VAR: '{"hybrid_shard_degree": 2'})
    message = str(info.value)
    assert ENV_VAR in message and "line 1, column 26" in message


def test_json_must_be_an_object(tmp_path):
    with pytest.raises(
        ConfigError, match=r"must hold a JSON object.*got \[1, 2\] \(a JSON array\)"
    ):
        load_raw(None, environ={ENV_VAR: "[1, 2]"})
    with pytest.raises(ConfigError, match=r"got null \(a JSON null\)"):
        load_raw(None, environ={ENV_VAR: "null"})
    with pytest.raises(ConfigError, match=r'got "tp" \(a JSON string\)'):
        load_raw(None, environ={ENV_VAR: '"tp"'})


def test_missing_file_and_wrong_argument_type(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_raw(str(tmp_path / "nope.json"), environ={})
    with pytest.raises(TypeError, match="takes a dict, a path to a JSON file or None"):
        load_raw(42, environ={})
    with pytest.raises(ConfigError, match="contains a NUL byte"):
        load_raw(str(tmp_path / "a\x00.json"), environ={})


def test_config_paths_that_are_pipes_are_read_within_a_bound(tmp_path, monkeypatch):
    import os
    import threading

    from torch_sagemaker import config_input

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    # Nobody writes: read as empty at once (open() waited for a writer forever).
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_raw(str(fifo), environ={})

    # A pipe whose writer is slow, as bash's <(...) may be, is waited for.
    read_end, write_end = os.pipe()

    def write() -> None:
        os.write(write_end, b'{"hybrid_shard_degree": 2}')
        os.close(write_end)

    writer = threading.Timer(0.2, write)
    writer.start()
    try:
        assert load_raw(f"/proc/self/fd/{read_end}", environ={}) == {"hybrid_shard_degree": 2}
    finally:
        writer.join()
        os.close(read_end)
    # A writer that never ends its text: an error within the bound.
    monkeypatch.setattr(config_input, "CONFIG_PIPE_WAIT_S", 0.3)
    read_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    write_end = os.open(fifo, os.O_WRONLY)
    try:
        with pytest.raises(ConfigError, match="gave no end of text within 0.3 s"):
            load_raw(str(fifo), environ={})
    finally:
        os.close(write_end)
        os.close(read_end)


def test_a_numpy_value_is_named_by_its_module():
    # numpy.bool_'s own name is "bool", which read as the type asked for.
    np = pytest.importorskip("numpy")
    (problem,) = problems({"sm_activation_offloading": np.bool_(True)})
    assert "must be a boolean (true or false), got numpy.bool" in problem, problem
    (problem,) = problems({"tensor_parallel_degree": np.int64(2)})
    assert "must be an integer, got numpy.int64" in problem, problem
