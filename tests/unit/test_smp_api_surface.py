"""SMP's module paths and the small APIs behind them, as SMP's example scripts use them (no
processes)."""

from __future__ import annotations

import ast
import functools
import importlib
import logging
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

# (module as SMP's scripts and docs import it, names they use from it): every module path of
# reference/smp_api.md. SMDDP's path, smdistributed.dataparallel.torch.torch_smddp, writes the
# launcher's variables into os.environ when imported, so tests/unit/test_import_paths.py
# imports it in a fresh interpreter instead.
SURFACE = [
    ("torch.sagemaker", ["init", "is_initialized", "state", "transform"]),
    ("torch.sagemaker.state_handler", ["state"]),
    ("torch.sagemaker.utils.utils", ["timeit"]),
    ("torch.sagemaker.utils.process_group_utils", ["get_global_ranks"]),
    ("torch.sagemaker.utils.module_utils", ["empty_module_params", "move_buffers_to_device"]),
    ("torch.sagemaker.logger", ["get_logger"]),
    ("torch.sagemaker.grad_norm", ["clip_grad_norm_"]),
    ("torch.sagemaker.delayed_param", ["DelayedParamIniter"]),
    (
        "torch.sagemaker.tensor_parallel.transformer",
        ["TransformerLayer", "TETransformerLayer", "TransformerLMHead"],
    ),
    ("torch.sagemaker.checkpoint.utils", ["SORT_BY_LAST_INT", "limit_num_subdirs"]),
    ("torch.sagemaker.checkpoint.constants", ["SMP_IS_LOAD_INFO_KEY", "SMP_IS_PARTIAL_KEY"]),
    (
        "torch.sagemaker.distributed.checkpoint",
        ["AsyncCallsQueue", "maybe_finalize_async_calls", "save", "async_save", "load"],
    ),
    (
        "torch.sagemaker.distributed.checkpoint.async_utils",
        ["AsyncCallsQueue", "maybe_finalize_async_calls"],
    ),
    (
        "torch.sagemaker.distributed.checkpoint.state_dict_saver",
        ["save", "async_save", "maybe_finalize_async_calls", "PyTorchDistSaveShardedStrategy"],
    ),
    ("torch.sagemaker.distributed.checkpoint.state_dict_loader", ["load"]),
    (
        "torch.sagemaker.distributed.checkpoint.state_dict_utils",
        [
            "sm_state_dict_type",
            "SMStateDictType",
            "init_optim_state",
            "compute_auto_checkpoint_interval",
            "_Interval",
            "SMP_IS_LOAD_INFO_KEY",
            "SMP_IS_PARTIAL_KEY",
        ],
    ),
    (
        "torch.sagemaker.distributed.checkpoint.filesystem",
        ["DistributedFileSystemReader", "DistributedFileSystemWriter", "path_to_file_system"],
    ),
    (
        "torch.sagemaker.distributed.fsdp.checkpoint",
        [
            "save_model_checkpoint",
            "load_model_checkpoint",
            "EXPORT_KEY_MODEL",
            "EXPORT_KEY_OPTIMIZER",
            "EXPORT_KEY_SCHEDULER",
            "EXPORT_KEY_IDENTITY",
        ],
    ),
    ("torch.sagemaker.nn.attn", ["FlashSelfAttention", "FlashGroupedQueryAttention"]),
    ("torch.sagemaker.nn.huggingface.llama_flashattn", ["LlamaFlashAttention"]),
    ("torch.sagemaker.moe.moe_config", ["MoEConfig"]),
    ("torch.sagemaker.moe.moe_layer", ["MoELayer"]),
    ("torch.sagemaker.context_parallel.utils", ["setup_transformer_engine_cp_groups"]),
    (
        "torch.sagemaker.distributed.checkpoint.s3_filesystem",
        [
            "S3FileSystem",
            "is_s3_uri",
            "parse_s3_uri",
            "format_s3_path",
            "get_s3_region_from_uri",
            "path_to_file_system",
            "retry_with_jitter",
        ],
    ),
]


def test_not_implemented_names_say_what_to_use():
    from torch.sagemaker.context_parallel.utils import setup_transformer_engine_cp_groups

    with pytest.raises(NotImplementedError, match="context_parallel_degree.*tsm.transform"):
        setup_transformer_engine_cp_groups(None, [0, 1], None)


def test_s3_uri_helpers_and_retry():
    from torch.sagemaker.distributed.checkpoint import s3_filesystem as s3

    assert s3.is_s3_uri("s3://bucket/a/b") and not s3.is_s3_uri("/tmp/a") and not s3.is_s3_uri(3)
    assert s3.parse_s3_uri("s3://bucket/a/b") == ("bucket", "a/b")
    assert s3.parse_s3_uri("s3://bucket") == ("bucket", "")
    assert s3.format_s3_path("bucket", "/a/b") == "s3://bucket/a/b"
    with pytest.raises(ValueError, match="names no bucket"):
        s3.parse_s3_uri("s3:///key")
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("transient")
        return "ok"

    assert s3.retry_with_jitter(flaky, max_attempts=3, base_delay=0.0) == "ok" and len(calls) == 3
    with pytest.raises(OSError):
        s3.retry_with_jitter(
            lambda: (_ for _ in ()).throw(OSError("down")), max_attempts=2, base_delay=0.0
        )


@pytest.mark.parametrize(("module", "names"), SURFACE, ids=[m for m, _ in SURFACE])
def test_smp_module_paths_import(module, names):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"


def test_public_functions_have_smp_signatures_and_docstrings():
    """``tsm.transform`` / ``tsm.offload_wrapper`` are the functions themselves, not shims."""
    import inspect

    import torch.sagemaker as tsm

    transform = inspect.signature(tsm.transform)
    assert list(transform.parameters) == [
        "model",
        "device",
        "dtype",
        "config",
        "load_state_dict_from_rank0",
        "cp_comm_type",
    ]
    assert transform.parameters["cp_comm_type"].default == "p2p"
    offload = inspect.signature(tsm.offload_wrapper)
    assert list(offload.parameters)[0] == "module"
    assert offload.parameters["activation_loading_horizon"].kind is inspect.Parameter.KEYWORD_ONLY
    for fn in (tsm.transform, tsm.offload_wrapper, tsm.init):
        assert not any(
            p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            for p in inspect.signature(fn).parameters.values()
        ), fn
        assert "Args:" in fn.__doc__, fn
    assert "Returns:" in tsm.transform.__doc__ and "Returns:" in tsm.offload_wrapper.__doc__


def test_deprecated_fsdp_checkpoint_module_warns_on_import():
    import torch_sagemaker.distributed.fsdp.checkpoint as shim

    with pytest.warns(
        FutureWarning, match="deprecated .* use torch.sagemaker.distributed.checkpoint"
    ):
        importlib.reload(shim)
    # As SMP 2.6.1 fixed it (aws/amazon-sagemaker-examples#4772): the name from the package.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from torch.sagemaker.distributed.fsdp import checkpoint
    assert checkpoint.save_model_checkpoint is shim.save_model_checkpoint


def test_state_handler_state_is_tsm_state():
    import torch.sagemaker as tsm
    from torch.sagemaker.state_handler import state

    assert state is tsm.state


# SMP's paths that are not where the code lives: (the path, the module it re-exports).
REEXPORTS = {
    # Not an SMP path: the backend's names where they lived before torch_sagemaker.smddp.
    "torch_sagemaker.distributed": "torch_sagemaker.smddp",
    "torch_sagemaker.distributed.checkpoint": "torch_sagemaker.checkpoint",
    **{
        f"torch_sagemaker.distributed.checkpoint.{name}": f"torch_sagemaker.checkpoint.{name}"
        for name in (
            "async_utils",
            "filesystem",
            "s3_filesystem",
            "state_dict_loader",
            "state_dict_saver",
            "state_dict_utils",
        )
    },
    "torch_sagemaker.distributed.fsdp.checkpoint": "torch_sagemaker.checkpoint.fsdp1_checkpoint",
    "torch_sagemaker.checkpoint.utils": "torch_sagemaker.checkpoint.retention",
    "torch_sagemaker.state_handler": "torch_sagemaker.state",
}
PACKAGE = Path(__file__).resolve().parents[2] / "torch_sagemaker"


def _module_path(module: str) -> Path:
    rel = Path(*module.split(".")[1:])
    return PACKAGE / rel / "__init__.py" if (PACKAGE / rel).is_dir() else PACKAGE / f"{rel}.py"


def reexport_problems(path: Path, home: str | None) -> list[str]:
    """Statements of the module at ``path`` other than its docstring, imports from ``home``,
    ``__all__`` and the deprecation warning (``import warnings``, ``warnings.warn(...)``)."""
    found = []
    body = ast.parse(path.read_text()).body
    for node in body[1:] if body and isinstance(body[0], ast.Expr) else body:
        text = ast.unparse(node)
        if isinstance(node, ast.ImportFrom) and node.module == home and not node.level:
            continue
        if isinstance(node, ast.Import) and text == "import warnings":
            continue
        if isinstance(node, ast.Assign) and text.startswith("__all__ = "):
            continue
        if isinstance(node, ast.Expr) and text.startswith("warnings.warn("):
            continue
        found.append(f"{path.name}:{node.lineno}: {text.splitlines()[0]}")
    return found


def test_smp_paths_that_reexport_define_nothing():
    """No logic in the re-exports, and nothing else under ``distributed/``: every name is the
    home module's own object, and the ``distributed.checkpoint`` paths export all of it."""
    under_distributed = {
        p for p in (PACKAGE / "distributed").rglob("*.py") if p.parent.name != "__pycache__"
    }
    assert len(under_distributed) == 10, sorted(under_distributed)  # the walk saw the files
    for path in under_distributed:
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        if module not in REEXPORTS:  # the package torch_sagemaker.distributed.fsdp
            assert ast.parse(path.read_text()).body[1:] == [], f"{module} defines something"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for module, home in REEXPORTS.items():
            assert reexport_problems(_module_path(module), home) == []
            shim, real = importlib.import_module(module), importlib.import_module(home)
            for name in shim.__all__:
                assert getattr(shim, name) is getattr(real, name), f"{module}.{name}"
            if module.startswith("torch_sagemaker.distributed."):
                assert sorted(shim.__all__) == sorted(real.__all__), module


@pytest.mark.parametrize(
    "source, expected",
    [
        ('"""Doc."""\nfrom torch_sagemaker.state import state\n__all__ = ["state"]\n', []),
        ('"""Doc."""\nimport os\n', ["m.py:2: import os"]),
        ('"""Doc."""\nfrom torch_sagemaker.config import load\n', ["m.py:2: from"]),
        ('"""Doc."""\ndef state():\n    return 1\n', ["m.py:2: def state():"]),
        ('"""Doc."""\nX = 1\n', ["m.py:2: X = 1"]),
    ],
)
def test_reexport_check_reports_definitions(tmp_path, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    found = reexport_problems(path, "torch_sagemaker.state")
    assert len(found) == len(expected) and all(f.startswith(e) for f, e in zip(found, expected)), (
        found
    )


def _capture_tsm_log():
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    from torch_sagemaker.logger import get_logger

    get_logger().addHandler(handler)
    return records, lambda: get_logger().removeHandler(handler)


def test_timeit_logs_once_on_rank_zero_only():
    from torch.sagemaker.utils import utils as tsm_utils

    records, detach = _capture_tsm_log()
    try:
        with tsm_utils.timeit(True, "Model creation", 0):
            pass
        with tsm_utils.timeit(True, "FSDP constructor", 1):
            pass
        with tsm_utils.timeit(False, "disabled", 0):
            pass
        with pytest.raises(KeyError), tsm_utils.timeit(True, "failing block", 0):
            raise KeyError("the error passes through")
    finally:
        detach()
    assert len(records) == 2
    assert records[0].startswith("Model creation took ") and records[0].endswith(" s")
    assert records[1].startswith("failing block took ")


def _tiny_llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg)


def test_transformer_layer_names_the_layers_tsm_transform_marked():
    from torch.distributed.fsdp.wrap import _or_policy, transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from torch_sagemaker.tensor_parallel import transformer
    from torch_sagemaker.tensor_parallel.transformer import (
        TETransformerLayer,
        TransformerLayer,
        TransformerLMHead,
    )

    model = _tiny_llama()
    layer = model.model.layers[0]
    assert not isinstance(layer, TransformerLayer) and not isinstance(model, TransformerLMHead)
    assert transformer.mark(model, LlamaDecoderLayer) == 2
    assert isinstance(layer, TransformerLayer) and isinstance(layer, TETransformerLayer)
    assert isinstance(layer, LlamaDecoderLayer)  # the Hugging Face class is kept
    assert isinstance(model, TransformerLMHead) and not isinstance(model, TransformerLayer)
    assert not isinstance(model.model.layers[0].self_attn, TransformerLayer)
    # As SMP's scripts build their FSDP auto-wrap policy and checkpoint check_fn.
    policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer}
    )
    wrapped = [n for n, m in model.named_modules() if n and _or_policy(m, False, 0, [policy])]
    assert wrapped == ["model.layers.0", "model.layers.1"]
    with pytest.raises(TypeError, match="names a role.*tsm.transform"):
        TransformerLayer()
    # Wrappers that forward attribute lookups to the layer are not layers themselves.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped_layer = checkpoint_wrapper(model.model.layers[1])
    assert wrapped_layer._tsm_role == "transformer_layer"  # forwarded by __getattr__
    assert not isinstance(wrapped_layer, TransformerLayer)


@pytest.mark.parametrize("layout", ["b h s d", "b s h d"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_self_attention_matches_softmax_attention(layout, causal):
    from torch.sagemaker.nn.attn import FlashSelfAttention

    torch.manual_seed(0)
    b, h, s, d = 2, 4, 7, 8
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3))
    scores = q @ k.transpose(-1, -2) / d**0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    expected = scores.softmax(-1) @ v
    to_layout = (lambda t: t) if layout == "b h s d" else (lambda t: t.transpose(1, 2))
    attn = FlashSelfAttention()
    packed = torch.cat([to_layout(t) for t in (q, k, v)], dim=1 if layout == "b h s d" else 2)
    for qkv in ((to_layout(q), to_layout(k), to_layout(v)), packed):
        out = attn(qkv, causal=causal, layout=layout)
        torch.testing.assert_close(out, to_layout(expected))
    out32 = attn(
        tuple(to_layout(t) for t in (q, k, v)),
        causal=causal,
        layout=layout,
        cast_dtype=torch.float32,
    )
    assert out32.dtype == torch.float64
    torch.testing.assert_close(out32, to_layout(expected), atol=1e-5, rtol=1e-5)


def test_flash_attention_options_and_bad_input_name_the_fix():
    from torch.sagemaker.nn.attn import FlashGroupedQueryAttention, FlashSelfAttention

    with pytest.raises(NotImplementedError, match="Triton"):
        FlashSelfAttention(triton_flash_attention=True)
    with pytest.raises(NotImplementedError, match="ALiBi"):
        FlashSelfAttention(use_alibi=True)
    x = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="layout='bshd'"):
        FlashSelfAttention()((x, x, x), layout="bshd")
    with pytest.raises(ValueError, match="not a multiple of 3 key/value heads"):
        FlashGroupedQueryAttention()(x, (x[:, :3], x[:, :3]))
    with pytest.raises(ValueError, match="qkv must hold 3 tensors"):
        FlashSelfAttention()((x, x))


def test_llama_flash_attention_swapped_in_as_smp_scripts_do_keeps_logits():
    from torch.sagemaker.nn.huggingface.llama_flashattn import LlamaFlashAttention

    model = _tiny_llama().eval()
    model.config.use_cache = False  # SMP's get_model_config sets it
    ids = torch.randint(0, 64, (2, 9))
    expected = model(input_ids=ids).logits
    for layer in model.model.layers:  # what SMP's train_utils does with use_smp_flash_attn
        prev = layer.self_attn
        layer.self_attn = LlamaFlashAttention(model.config)
        layer.self_attn.pretraining_tp = model.config.pretraining_tp
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, name).weight.copy_(getattr(prev, name).weight)
    torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
    # Padding masks reach the attention as Hugging Face builds them.
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    flash = model(input_ids=ids, attention_mask=mask).logits
    for layer, attn in zip(model.model.layers, _tiny_llama().model.layers, strict=True):
        attn.self_attn.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = attn.self_attn
    torch.testing.assert_close(
        flash[1], model(input_ids=ids, attention_mask=mask).logits[1], atol=1e-5, rtol=1e-5
    )
    with pytest.raises(ValueError, match="without layer_idx.*use_cache=False"):
        model.model.layers[0].self_attn = LlamaFlashAttention(model.config)
        model(input_ids=ids, use_cache=True)


def test_llama_flash_attention_with_layer_idx_generates_like_llama_attention():
    from torch.sagemaker.nn.huggingface.llama_flashattn import LlamaFlashAttention

    model = _tiny_llama().eval()
    ids = torch.randint(0, 64, (1, 5))
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    for i, layer in enumerate(model.model.layers):
        flash = LlamaFlashAttention(model.config, layer_idx=i)
        flash.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = flash
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_offload_wrapper_without_checkpointing_prefetches_over_transformer_layers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper

    import torch_sagemaker as tsm
    from torch_sagemaker.offload import NativeOffloadWrapper
    from torch_sagemaker.offload.wrapper import PrefetchOffloadWrapper

    reference = _tiny_llama()
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 8))
    reference(input_ids=ids, labels=ids).loss.backward()
    wrapped = tsm.offload_wrapper(model)  # the default config: sm_activation_offloading=True
    assert isinstance(wrapped, PrefetchOffloadWrapper)
    wrapped(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    from torch_sagemaker.offload import get_stats

    assert get_stats(wrapped).layers == 2  # one unit per LlamaDecoderLayer

    records, detach = _capture_tsm_log()
    try:
        plain = tsm.offload_wrapper(_Plain())
    finally:
        detach()
    # PyTorch's wrapper, as PyTorch's offload_wrapper gives (a subclass that also saves DTensors)
    assert type(plain) is NativeOffloadWrapper and isinstance(plain, OffloadWrapper)
    assert any("no checkpointed or transformer layers" in r for r in records)
    plain(torch.ones(2, 4)).sum().backward()


def test_cache_flush_watch_warns_when_the_allocator_retried(monkeypatch):
    from torch_sagemaker.sharding import cache_flush

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cache_flush.watch(nn.Linear(2, 2)) is False  # CPU: nothing to watch
    retries = [3]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": retries[0]})
    model = nn.Linear(2, 2)
    assert cache_flush.watch(model) and not cache_flush.watch(model)  # once per root
    records, detach = _capture_tsm_log()
    try:
        model(torch.ones(1, 2))  # no retry since the watch started
        retries[0] = 5
        model(torch.ones(1, 2))
        model(torch.ones(1, 2))  # none since the previous step
    finally:
        detach()
    assert len(records) == 1 and "flushed its cache 2 time(s)" in records[0]
    assert "Raise hybrid_shard_degree" in records[0]
