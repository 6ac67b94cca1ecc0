"""``tsm.transform`` arguments that used to fail late or on one rank only fail early and alike.

- ``dtype="float16"`` (a string) was read by ``Tensor.to`` as a device and reported as an
  invalid device string; a non-device ``device`` failed inside torch.
- ``intermediate_size`` not divisible by the tensor parallel degree failed inside DTensor
  at the first forward.
- ``load_state_dict_from_rank0=True`` with meta weights on rank 0 raised on rank 0 only,
  while the other ranks went on into the weight broadcast and failed with an unrelated
  mismatch; now every rank raises the same error.
- A tied model (``tie_word_embeddings``) loaded from rank 0 failed in the weight broadcast
  with a collective mismatch: the other ranks' models, built under ``init_empty_weights``,
  were untied (one parameter more). Now transform ties as the config says (Note [Tie before
  transform]), and models that differ across ranks stop every rank with the same error.
- With tp = cp = ep = 1, ``transform`` made an all-reduce on the world group (to agree on
  meta weights that nothing then read); now it makes no collective call at all.
- A tied model loaded from rank 0 with tensor parallel degree 1 hung: the other ranks'
  ``to_empty`` untied the head from the embedding again (one parameter more than rank 0
  sends). Now the tie survives the allocation, and tensor lists that still differ when the
  weights are sent (here: another dtype on one rank) stop every rank with the same error
  (Note [One tensor list for the broadcast]).
"""

from __future__ import annotations

import os

import pytest

from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

# Collective and point-to-point functions of torch.distributed (what code calls by name).
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


class _CountCollectives:
    """Counts calls of ``_COLLECTIVES`` (through ``torch.distributed`` or ``distributed_c10d``)
    whose group is the world group, while the context is open."""

    def __enter__(self):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        self.calls: list[str] = []
        self._saved = []
        for name in _COLLECTIVES:
            original = getattr(c10d, name)

            def counting(*args, __name=name, __original=original, **kwargs):
                group = kwargs.get("group", kwargs.get("process_group"))
                if group is None or group is dist.group.WORLD or group is c10d._get_default_group():
                    self.calls.append(__name)
                return __original(*args, **kwargs)

            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, counting)
        return self

    def __exit__(self, *exc):
        for module, name, original in self._saved:
            setattr(module, name, original)


def _errors() -> dict:
    import torch
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from accelerate import init_empty_weights

    from tests.distributed.hf_models import tiny_llama

    tsm.init({"tensor_parallel_degree": 2})
    out = {}

    def attempt(name, make, **kwargs):
        try:
            tsm.transform(make(), **kwargs)
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    attempt("dtype", tiny_llama, dtype="float16")
    attempt("int_dtype", tiny_llama, dtype=torch.int8)
    attempt("device", tiny_llama, device="gpu0")
    # A GPU this process does not have (none on a CPU machine; past the count on a GPU one).
    attempt("missing_gpu", tiny_llama, device=f"cuda:{torch.cuda.device_count() + 7}")
    attempt("intermediate", lambda: tiny_llama(intermediate_size=129))
    with init_empty_weights():  # meta weights on every rank, rank 0 included
        attempt("rank0_meta", tiny_llama, load_state_dict_from_rank0=True)
    # The group is still in step: a real rank-0 load works right after.
    if dist.get_rank() == 0:
        model = tiny_llama(seed=5)
    else:
        with init_empty_weights():
            model = tiny_llama(seed=9)
    with _CountCollectives() as counter:  # the counter sees what transform does with tp=2
        model = tsm.transform(model, load_state_dict_from_rank0=True)
    out["tp2_world_calls"] = counter.calls
    weight = model.model.layers[0].mlp.up_proj.weight.full_tensor()
    out["loaded"] = bool(torch.equal(weight, tiny_llama(seed=5).model.layers[0].mlp.up_proj.weight))
    # A tied model: real on rank 0, from the config on meta (untied there) elsewhere.
    if dist.get_rank() == 0:
        tied = tiny_llama(seed=6, tie_word_embeddings=True)
    else:
        with init_empty_weights():
            tied = tiny_llama(seed=9, tie_word_embeddings=True)
        out["meta_untied"] = tied.lm_head.weight is not tied.model.embed_tokens.weight
    tied = tsm.transform(tied, load_state_dict_from_rank0=True)
    out["tied"] = tied.lm_head.weight is tied.model.embed_tokens.weight
    want = tiny_llama(seed=6, tie_word_embeddings=True).model.embed_tokens.weight
    out["tied_loaded"] = bool(torch.equal(tied.model.embed_tokens.weight.full_tensor(), want))
    # A resize that keeps the size (scripts call it with len(tokenizer)) works as before.
    kept = tied.resize_token_embeddings(tied.config.vocab_size)
    out["same_size_resize"] = kept is tied.model.embed_tokens
    try:  # Hugging Face's resize fails inside DTensor; the error says what to do instead
        tied.resize_token_embeddings(160)
        out["resize"] = "no error"
    except RuntimeError as e:
        out["resize"] = str(e)
    # save_pretrained of the split weights is refused on the calling rank, naming the fix;
    # a state dict of full tensors saves (rank 0 alone calls it, as scripts do).
    import copy
    import shutil
    import tempfile

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    directory = tempfile.mkdtemp()
    try:
        tied.save_pretrained(f"{directory}/shards")
        out["save_pretrained"] = "no error"
    except RuntimeError as e:
        out["save_pretrained"] = str(e)
    full = get_model_state_dict(tied, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        # (Hugging Face's save_pretrained empties the dict it is given: one copy per call.)
        tied.save_pretrained(f"{directory}/full", state_dict=dict(full))
        tied.save_pretrained(f"{directory}/positional", True, dict(full))  # by position
        out["saved"] = [sorted(os.listdir(f"{directory}/{d}")) for d in ("full", "positional")]
    shutil.rmtree(directory)
    clone = copy.deepcopy(tied)  # the replaced methods act on the copy
    out["rebound"] = [
        getattr(clone, m).__self__ is clone for m in ("save_pretrained", "resize_token_embeddings")
    ]
    layers = 2 if dist.get_rank() == 0 else 3
    attempt(
        "different", lambda: tiny_llama(num_hidden_layers=layers), load_state_dict_from_rank0=True
    )
    return out


def test_transform_argument_errors_are_early_clear_and_on_every_rank():
    results = run_distributed(_errors, world_size=2, timeout=300)
    for out in results:
        assert out["dtype"].startswith(
            "TypeError: tsm.transform(dtype='float16'): dtype must be a floating torch.dtype"
        ), out
        assert "pass dtype=torch.float16" in out["dtype"], out
        assert "dtype must be a floating torch.dtype" in out["int_dtype"], out
        # The fix names a floating dtype, not the integer one given.
        assert "pass dtype=torch.int8" not in out["int_dtype"], out
        assert "Resize before tsm.transform" in out["resize"], out["resize"]
        assert out["same_size_resize"], out
        assert "save_hf_checkpoint(model, directory) on every rank" in out["save_pretrained"], out
        assert out["rebound"] == [True, True], out
        assert "torch.bfloat16" in out["int_dtype"], out
        assert out["device"].startswith("ValueError: tsm.transform(device='gpu0') is not a device")
        assert out["missing_gpu"].startswith("ValueError: tsm.transform(device='cuda:"), out
        assert "this process sees" in out["missing_gpu"], out
        assert (
            "tensor_parallel_degree=2 does not divide intermediate_size=129" in out["intermediate"]
        ), out
        assert out["rank0_meta"].startswith(
            "ValueError: load_state_dict_from_rank0=True needs real weights on rank 0"
        ), out
        assert out["loaded"] is True
        assert out["tied"] and out["tied_loaded"] and out.get("meta_untied", True), out
        assert out["different"].startswith(
            "ValueError: load_state_dict_from_rank0=True needs the same model on every rank, "
            "but rank 1's differs from rank 0's: "
        ), out
        assert "broadcast" in out["tp2_world_calls"], out["tp2_world_calls"]
    assert results[0]["rank0_meta"] == results[1]["rank0_meta"]
    assert results[0]["different"] == results[1]["different"]
    # Rank 0 alone saved the full tensors, positional state_dict included.
    assert all("model.safetensors" in files for files in results[0]["saved"]), results[0]


def _world_calls_without_model_parallelism() -> dict:
    import torch.sagemaker as tsm
    from accelerate import init_empty_weights

    from tests.distributed.hf_models import tiny_llama

    tsm.init({})  # tp = cp = ep = 1: hybrid sharding over both ranks only
    out = {}
    with _CountCollectives() as counter:
        tsm.transform(tiny_llama())
    out["real"] = counter.calls
    with init_empty_weights(), _CountCollectives() as counter:
        tsm.transform(tiny_llama())
    out["meta"] = counter.calls
    return out


def test_transform_makes_no_world_collective_without_model_parallelism():
    for out in run_distributed(_world_calls_without_model_parallelism, world_size=2, timeout=300):
        assert out == {"real": [], "meta": []}, out


def _tied_rank0_load_without_tp() -> dict:
    """A tied model from rank 0 with tensor parallel degree 1: replicated, then FSDP2-sharded."""
    import torch
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from accelerate import init_empty_weights
    from torch.distributed.fsdp import fully_shard

    from tests.distributed.hf_models import tiny_llama
    from torch_sagemaker.policies import transformer_layer_classes

    ref = tiny_llama(seed=6, tie_word_embeddings=True)
    want = {n: t for n, t in [*ref.named_parameters(), *ref.named_buffers()]}
    ids = torch.arange(16).reshape(2, 8) % 100
    with torch.no_grad():
        want_loss = float(ref(input_ids=ids, labels=ids).loss)

    def load(dtype=torch.float32):
        if dist.get_rank() == 0:
            model = tiny_llama(seed=6, tie_word_embeddings=True)
        else:
            with init_empty_weights():
                model = tiny_llama(seed=9, tie_word_embeddings=True).to(dtype)
        return tsm.transform(model, load_state_dict_from_rank0=True)

    def loaded(model) -> dict:
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return {
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "names": [n for n, _ in tensors],
            "equal": [n for n, t in tensors if torch.equal(t.detach(), want[n])],
        }

    out = {}
    tsm.init({"hybrid_shard_degree": 1})
    try:  # another dtype on rank 1 only: caught before the first weight is sent
        load(torch.bfloat16)
        out["dtype"] = "no error"
    except RuntimeError as e:
        out["dtype"] = str(e)
    out["replicated"] = loaded(load())  # the group is in step after the error
    tsm.state.reset()
    tsm.init({"hybrid_shard_degree": 2})
    model = load()
    out["before_fsdp2"] = loaded(model)
    layer_classes = transformer_layer_classes(model)
    for module in model.modules():
        if isinstance(module, layer_classes):
            fully_shard(module, mesh=tsm.state.fsdp_mesh)
    fully_shard(model, mesh=tsm.state.fsdp_mesh)
    out["fsdp2_tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    out["fsdp2_embed"] = torch.equal(
        model.model.embed_tokens.weight.full_tensor(), want["model.embed_tokens.weight"]
    )
    with torch.no_grad():
        out["fsdp2_loss"] = abs(float(model(input_ids=ids, labels=ids).loss) - want_loss)
    out["want_names"] = list(want)
    return out


def test_tied_model_from_rank0_without_tensor_parallelism_keeps_the_tie():
    results = run_distributed(_tied_rank0_load_without_tp, world_size=2, timeout=240)
    for rank, out in enumerate(results):
        assert out["dtype"].startswith(
            "load_state_dict_from_rank0=True: the tensors rank 0 broadcasts and those the "
            "other ranks receive do not pair up after sharding (tensor 0 is "
            "model.embed_tokens.weight [256, 64] bfloat16 on rank 1 and "
            "model.embed_tokens.weight [256, 64] float32 on rank 0"
        ), (rank, out["dtype"])
        for layout in ("replicated", "before_fsdp2"):
            r = out[layout]
            assert r["tied"], (rank, layout)
            assert r["names"] == out["want_names"], (rank, layout, r["names"])  # 20 + 1 buffer
            assert r["equal"] == out["want_names"], (rank, layout)  # rank 0's weights
        assert out["fsdp2_tied"] and out["fsdp2_embed"], (rank, out)
        assert out["fsdp2_loss"] < 1e-5, (rank, out["fsdp2_loss"])
    assert results[0]["dtype"] == results[1]["dtype"]
