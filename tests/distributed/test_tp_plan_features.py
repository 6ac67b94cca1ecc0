"""The library's features on a model no policy covers (Qwen3: its transformers TP plan).

One launch of 2 ranks runs every case, each under its own ``tsm.init``:

- tensor parallelism 2 with FSDP2: train 4 steps, saving after step 2 a sharded checkpoint
  (``TrainingState``) and a full one (gathered model and optimizer state); fresh models
  (another seed; the one for the sharded checkpoint built on the meta device and
  initialized late, equal to an unsharded delayed init) load each and train steps 3-4: the
  losses equal the uninterrupted run's.
  The trained model's Hugging Face export reloads with ``from_pretrained`` and gives its
  logits;
- the same layout, steps 1-2 fed embeddings (``inputs_embeds``): the input embedding gets no
  gradient, so AdamW has no state for it in the step-2 sharded and SM-local checkpoints; a
  fresh model resumes from each without inventing that state and trains steps 3-4 on token
  ids (the embedding's first gradient) exactly as the uninterrupted run;
- the same layout with the offload wrapper, prefetching and (``sm_activation_offloading``
  false) PyTorch's: loss and every gradient bit-identical to the run without it;
- context parallelism 2 (standard attention) against one process (``cp_cases``);
- expert parallelism 2 on OLMoE (experts named by its plan, the model's own router:
  ``MoEConfig(smp_moe=False)``) against one process (``moe_models``);
- a module the plan leaves out that computes on split activations (Qwen3's per-head
  norms, dropped from the plan) is caught on first use on every rank, not replicated;
- one key/value head under tensor parallelism 2 (replicated per rank) matches one process;
- OPT, which transformers ships no plan for, sharded through a plan the user sets
  (``model.tp_plan = ...``, without the tied input embedding) matches one process;
- sequence and token classification heads keep their own losses, equal to one process's;
- StarCoder2's residual dropout inside attention draws one process's masks; so does
  GPT-Neo's, whose attention module holds another (a user's plan; Note [Nested attention
  modules]).
"""

from __future__ import annotations

import copy
import json

import pytest

from tests.distributed import cp_cases, moe_models
from tests.distributed.launcher import run_distributed

pytestmark = pytest.mark.distributed

FAMILY = "qwen3"
STEPS, SAVE_AT = 4, 2


def _build(seed: int):
    """Qwen3 (its plan), tensor parallel, FSDP2 over the TP layout, AdamW."""
    import torch
    import torch.sagemaker as tsm

    from tests.distributed.test_tp_parity import build
    from torch_sagemaker.sharding import shard_model

    model = tsm.transform(build(FAMILY, seed=seed))
    shard_model(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _build_delayed(seed: int):
    """The same on the meta device: transform, FSDP2, then delayed initialization; also
    whether the values equal an unsharded delayed init of the same seed."""
    import torch
    import torch.sagemaker as tsm
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from tests.distributed.test_tp_parity import tiny_config
    from torch_sagemaker.delayed_param import DelayedParamIniter
    from torch_sagemaker.sharding import shard_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(FAMILY))
        ref = AutoModelForCausalLM.from_config(tiny_config(FAMILY))
    model = tsm.transform(model)  # stays on meta (its DTensors too)
    initer = DelayedParamIniter(model, seed=seed, device="cpu")
    shard_model(model)
    initer.init_model()
    DelayedParamIniter(ref, seed=seed, device="cpu").init_model()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    same = all(torch.equal(full[k], v) for k, v in ref.state_dict().items())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), same


def _train(model, optim, steps) -> list[float]:
    from tests.distributed.test_tp_parity import batch

    losses = []
    for step in steps:
        ids = batch(step)  # the TP group shares each step's batch
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _full_state(model, optim):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, [optim], options=StateDictOptions(full_state_dict=True))


def _load_full(model, optim, path: str) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    full = torch.load(path, weights_only=False)  # every rank reads the one file
    set_state_dict(
        model,
        [optim],
        model_state_dict=full["model"],
        optim_state_dict=full["optim"],
        options=StateDictOptions(full_state_dict=True),
    )


def _checkpoints_and_export(root: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torch_sagemaker.checkpoint import TrainingState, save_hf_checkpoint

    model, optim = _build(seed=1)
    losses = _train(model, optim, range(SAVE_AT))
    TrainingState(model, optim, step=SAVE_AT).save(f"{root}/sharded")
    msd, osd = _full_state(model, optim)
    if dist.get_rank() == 0:
        torch.save({"model": msd, "optim": osd}, f"{root}/full.pt")
    dist.barrier()
    losses += _train(model, optim, range(SAVE_AT, STEPS))
    out = {"losses": losses, "path": model._tsm_policy.name}
    probe = torch.arange(32).reshape(2, 16) % 128
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    out["logits"] = (logits.full_tensor() if isinstance(logits, DTensor) else logits).clone()
    save_hf_checkpoint(model, f"{root}/hf")

    model, optim, out["delayed_init_equal"] = _build_delayed(seed=2)
    state = TrainingState(model, optim)
    state.load(f"{root}/sharded")
    out["sharded"] = (state.step, _train(model, optim, range(SAVE_AT, STEPS)))
    model, optim = _build(seed=3)
    _load_full(model, optim, f"{root}/full.pt")
    out["full"] = _train(model, optim, range(SAVE_AT, STEPS))
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(f"{root}/hf")
        with torch.no_grad():
            out["exported"] = hf(input_ids=probe).logits
        with open(f"{root}/hf/config.json") as f:
            out["exported_config"] = json.load(f)
    return out


def _unused_until_resumed(root: str) -> dict:
    """Steps 1-2 on embeddings, saves, resumes on token ids (see the module docstring).

    Note [Parameters without optimizer state] in ``torch_sagemaker/checkpoint/training_state.py``.
    """
    import torch

    from tests.distributed.test_tp_parity import batch, full
    from torch_sagemaker.checkpoint import CheckpointError, TrainingState

    def train(model, optim, steps) -> list[float]:
        losses = []
        for step in steps:
            ids = batch(step)
            if step < SAVE_AT:  # embeddings from elsewhere: embed_tokens gets no gradient
                g = torch.Generator().manual_seed(step)
                inputs = {"inputs_embeds": torch.randn(*ids.shape, 64, generator=g)}
            else:
                inputs = {"input_ids": ids}
            loss = model(**inputs, labels=ids, use_cache=False).loss
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        return losses

    def stateless(model, optim) -> list[str]:
        return [n for n, p in model.named_parameters() if p not in optim.state]

    model, optim = _build(seed=1)
    losses = train(model, optim, range(SAVE_AT))
    out: dict = {"saved_without_state": stateless(model, optim)}
    for kind in ("sharded", "local"):
        TrainingState(model, optim, step=SAVE_AT).save(f"{root}/unused_{kind}", kind=kind)
    out["losses"] = losses + train(model, optim, range(SAVE_AT, STEPS))
    params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    for kind in ("sharded", "local"):
        model, optim = _build(seed=3)
        try:  # raised on every rank alike; only this case's test fails
            TrainingState(model, optim).load(f"{root}/unused_{kind}", kind=kind)
        except CheckpointError as e:
            out[kind] = {"error": str(e)}
            continue
        out[kind] = {
            "loaded_without_state": stateless(model, optim),
            "losses": train(model, optim, range(SAVE_AT, STEPS)),
            "param_diff": max(
                float((full(p).detach() - params[n]).abs().max())
                for n, p in model.named_parameters()
            ),
        }
    return out


def _offload() -> dict:
    import torch.sagemaker as tsm
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

    from tests.distributed.test_delayed_param import fresh_layout
    from tests.distributed.test_offload_parallel import _compare, _step
    from tests.distributed.test_tp_parity import build
    from tools.model_coverage.parity import checkpoint_and_shard
    from torch_sagemaker.offload import get_stats

    def model():
        m = tsm.transform(build(FAMILY))
        checkpoint_and_shard(m)  # checkpointing on the plan's layer class, FSDP2
        return m

    off = _step(model(), 0)
    wrapped = cw.offload_wrapper(model())  # the SMP script path
    result = _compare(_step(wrapped, 0), off)
    result["offloaded"] = get_stats(wrapped).bytes_offloaded
    # The flag off: PyTorch's wrapper, which must save the DTensors of the TP layout too
    # (Note [DTensors under PyTorch's offload wrapper]). The layout stays for the next cases.
    fresh_layout({"tensor_parallel_degree": 2, "sm_activation_offloading": False})
    native = cw.offload_wrapper(model())
    result["native_type"] = type(native).__name__
    result["native"] = _compare(_step(native, 0), off)
    return result


def _one_kv_head() -> dict:
    """Qwen3 with one kv head under tp 2: the plan's k/v projections are replicated per rank."""
    import torch.sagemaker as tsm

    from tests.distributed.test_tp_parity import batch, build, compare_forward_backward

    ref = build(FAMILY, num_key_value_heads=1)
    model = tsm.transform(copy.deepcopy(ref))
    kv = model.model.layers[0].self_attn.k_proj.weight
    result = compare_forward_backward(model, ref, batch(0))
    result["k_proj"] = ([p.is_replicate() for p in kv.placements], tuple(kv.to_local().shape))
    return result


def _user_plan() -> dict:
    """OPT through the plan a user sets (``OPT_PLAN``): heads split, tied embedding added."""
    import torch
    import torch.sagemaker as tsm
    import transformers as tf

    from tests.distributed.test_tp_parity import batch, compare_forward_backward
    from tests.unit.test_transformers_plan import OPT_PLAN

    config = tf.OPTConfig(
        vocab_size=128,
        hidden_size=64,
        word_embed_proj_dim=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    ref = tf.AutoModelForCausalLM.from_config(config).float()
    model = copy.deepcopy(ref)
    model.tp_plan = OPT_PLAN
    model = tsm.transform(model)
    result = compare_forward_backward(model, ref, batch(0))
    decoder = model.model.decoder
    result["shapes"] = [
        tuple(decoder.layers[0].self_attn.q_proj.weight.to_local().shape),
        tuple(decoder.embed_tokens.weight.to_local().shape),
    ]
    return result


def _conflicting_tied_plan() -> str:
    """OPT's tied head made a parameter holder beside a vocabulary-split input embedding."""
    import torch.sagemaker as tsm
    import transformers as tf

    from tests.unit.test_transformers_plan import OPT_PLAN

    config = tf.OPTConfig(
        vocab_size=128, hidden_size=64, word_embed_proj_dim=64, ffn_dim=128,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(config)
    model.tp_plan = {
        **OPT_PLAN,
        "model.decoder.embed_tokens": "embedding_rowwise",
        "lm_head": "local_params",
    }
    try:
        tsm.transform(model)
    except ValueError as e:
        return str(e)
    return "no error"


def _dropped_norms() -> str:
    import torch.sagemaker as tsm

    from tests.distributed.test_tp_parity import batch, build

    model = build(FAMILY)
    model.tp_plan = {k: v for k, v in model.tp_plan.items() if not k.endswith("_norm")}
    model = tsm.transform(model)
    ids = batch(0)
    try:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    except ValueError as e:
        return str(e)
    return f"no error; q_norm weight type {type(model.model.layers[0].self_attn.q_norm.weight)}"


def _classification_heads() -> dict:
    """Sequence and token classification heads on the plan: each keeps its own loss."""
    import torch
    import torch.sagemaker as tsm
    import transformers as tf

    from tests.distributed.test_tp_parity import build

    config = build(FAMILY).config
    config.num_labels, config.pad_token_id = 3, 0
    ids = torch.tensor([[5, 64, 70, 64, 3, 100, 7, 64]])
    out = {}
    for head, labels in (
        (tf.AutoModelForSequenceClassification, torch.tensor([2])),
        (tf.AutoModelForTokenClassification, torch.tensor([[0, 1, 2, 1, 0, 2, 1, 0]])),
    ):
        torch.manual_seed(0)
        ref = head.from_config(config).float().eval()
        model = tsm.transform(copy.deepcopy(ref)).eval()
        got = model(input_ids=ids, labels=labels).loss
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        out[head.__name__] = abs(got.item() - ref(input_ids=ids, labels=labels).loss.item())
    return out


def _with_the_same_draws(model, ref) -> dict:
    """Loss and gradient differences of ``model`` and ``ref`` from one seed of the shared stream
    (so the same dropout masks where both draw alike)."""
    import torch

    from tests.distributed.test_tp_parity import gradient_diffs

    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (model, ref):
        torch.manual_seed(9)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    return {"loss": abs(losses[0] - losses[1]), "grads": max(gradient_diffs(model, ref).values())}


def _residual_dropout_inside_attention() -> dict:
    """StarCoder2 drops out the projected attention output inside its attention module."""
    import torch
    import torch.sagemaker as tsm
    import transformers as tf

    config = tf.Starcoder2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        residual_dropout=0.2,
        attention_dropout=0.0,
        embedding_dropout=0.0,
    )
    torch.manual_seed(0)
    ref = tf.AutoModelForCausalLM.from_config(config).float().train()
    model = tsm.transform(copy.deepcopy(ref)).train()
    return _with_the_same_draws(model, ref)


def _nested_attention() -> dict:
    """GPT-Neo (its attention holds another attention module) with residual dropout."""
    import torch
    import torch.sagemaker as tsm
    import transformers as tf

    config = tf.GPTNeoConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        max_position_embeddings=64,
        resid_dropout=0.2,
        embed_dropout=0.1,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    ref = tf.AutoModelForCausalLM.from_config(config).float().train()
    model = copy.deepcopy(ref)
    layer = "transformer.h.*"
    model.tp_plan = {
        **{f"{layer}.attn.attention.{p}_proj": "colwise" for p in "qkv"},
        f"{layer}.attn.attention.out_proj": "rowwise",
        f"{layer}.mlp.c_fc": "colwise",
        f"{layer}.mlp.c_proj": "rowwise",
        "lm_head": "colwise_gather_output",
    }
    model = tsm.transform(model).train()
    return _with_the_same_draws(model, ref)


def _all(root: str) -> dict:
    from tests.distributed.test_delayed_param import fresh_layout

    out = {}
    fresh_layout({"tensor_parallel_degree": 2})
    out["checkpoints"] = _checkpoints_and_export(root)
    out["unused_until_resumed"] = _unused_until_resumed(root)
    fresh_layout({"tensor_parallel_degree": 2, "activation_loading_horizon": 2})
    out["offload"] = _offload()
    out["dropped_norms"] = _dropped_norms()
    out["one_kv_head"] = _one_kv_head()
    out["user_plan"] = _user_plan()
    out["conflicting_tied_plan"] = _conflicting_tied_plan()
    out["classification"] = _classification_heads()
    out["residual_dropout"] = _residual_dropout_inside_attention()
    out["nested_attention"] = _nested_attention()
    fresh_layout({"context_parallel_degree": 2})
    out["cp"] = cp_cases.run_case(FAMILY, "p2p", "fsdp2")
    fresh_layout({"expert_parallel_degree": 2})
    out["ep"] = moe_models.parity_case(
        "olmoe", "fsdp2", {"smp_moe": False, "moe_load_balancing": "none"}
    )
    out["ep_gpt_oss"] = moe_models.parity_case(
        "gpt_oss", "fsdp2", {"smp_moe": False, "moe_load_balancing": "none"}
    )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("plan"))
    return run_distributed(_all, root, world_size=2, timeout=400)


def test_sharded_and_full_checkpoints_resume_exactly(results):
    import torch

    for rank, r in enumerate(results):
        c = r["checkpoints"]
        assert c["path"] == "qwen3 (transformers plan)"
        expected = c["losses"][SAVE_AT:]
        assert len(set(c["losses"])) == STEPS, c["losses"]
        assert c["delayed_init_equal"], f"rank {rank}: delayed init differs from unsharded"
        step, sharded = c["sharded"]
        assert step == SAVE_AT
        torch.testing.assert_close(sharded, expected, rtol=1e-6, atol=1e-6, msg=f"rank {rank}")
        torch.testing.assert_close(c["full"], expected, rtol=1e-6, atol=1e-6, msg=f"rank {rank}")


def test_parameters_without_optimizer_state_resume_exactly(results):
    # The checkpoints hold no AdamW state for the embedding (no gradient before the save):
    # the load used to ask for it and fail; loading zero state created for the template
    # would change the embedding's first update after the resume.
    import torch

    for rank, r in enumerate(results):
        c = r["unused_until_resumed"]
        assert c["saved_without_state"] == ["model.embed_tokens.weight"], c
        for kind in ("sharded", "local"):
            got = c[kind]
            assert "error" not in got, (kind, got)
            assert got["loaded_without_state"] == ["model.embed_tokens.weight"], (kind, got)
            torch.testing.assert_close(
                got["losses"], c["losses"][SAVE_AT:], rtol=1e-6, atol=1e-6, msg=f"{kind} {rank}"
            )
            assert got["param_diff"] <= 1e-6, (kind, rank, got["param_diff"])


def test_hf_export_reloads_with_the_same_logits(results):
    import torch

    c = results[0]["checkpoints"]
    torch.testing.assert_close(c["exported"], c["logits"], rtol=1e-5, atol=1e-5)
    assert c["logits"].abs().max() > 0
    # What save_pretrained writes too: the class serving stacks pick, and the weights' dtype.
    config = c["exported_config"]
    assert config["architectures"] == ["Qwen3ForCausalLM"], config.get("architectures")
    assert config["dtype"] == "float32", config.get("dtype")


def test_offload_wrapper_is_bit_identical(results):
    for r in results:
        case = r["offload"]
        assert case["loss_equal"] and case["names_equal"], case
        assert case["unequal"] == [] and case["nonzero"], case
        assert case["offloaded"] > 0, case
        native = case["native"]
        assert case["native_type"] == "NativeOffloadWrapper", case
        assert native["loss_equal"] and native["unequal"] == [] and native["nonzero"], native


def test_context_parallel_matches_one_process(results):
    for r in results:
        cp_cases.check(r["cp"], what="qwen3 cp2")


def test_expert_parallel_on_plan_experts_matches_one_process(results):
    for r in results:
        assert r["ep"]["local_experts"] == [(2, 32, 24), (2, 48, 32)], r["ep"]  # 2 of 4 experts
        moe_models.check({f"olmoe rank {rank}": r["ep"] for rank, r in enumerate(results)})


def test_expert_parallel_on_experts_named_only_in_the_ep_plan(results):
    """GPT-OSS: its TP plan names only the embedding, its EP plan the (biased) experts (Note
    [Experts named only in the EP plan]): each rank holds 2 of the 4 experts, biases too."""
    for r in results:
        assert r["ep_gpt_oss"]["local_experts"] == [(2, 24, 32), (2, 32), (2, 32, 48), (2, 48)]
    moe_models.check({f"gpt_oss rank {rank}": r["ep_gpt_oss"] for rank, r in enumerate(results)})


def test_fewer_kv_heads_than_ranks(results):
    from tests.distributed.test_tp_parity import ATOL

    for r in results:
        case = r["one_kv_head"]
        assert case["k_proj"] == ([True], (16, 64)), case["k_proj"]  # replicated: the one head
        assert case["logits"] < ATOL and case["loss"] < ATOL, case
        bad = {n: d for n, d in case["grads"].items() if d > ATOL}
        assert not bad and case["grad_scale"] > 1e-4, bad


def test_a_plan_the_user_sets_on_a_model_without_one(results):
    from tests.distributed.test_tp_parity import ATOL

    for r in results:
        case = r["user_plan"]
        assert case["shapes"] == [(32, 64), (64, 64)], case["shapes"]  # 2 of 4 heads; vocab half
        assert case["logits"] < ATOL and case["loss"] < ATOL, case
        bad = {n: d for n, d in case["grads"].items() if d > ATOL}
        assert not bad and case["grad_scale"] > 1e-4, bad


def test_tied_parameters_split_unalike_are_refused(results):
    # A parameter holder follows a tied split only for a module below it (RoBERTa's head
    # bias, Note [Tied parameters of parameter holders]); here the head and the embedding
    # are apart, and a whole head beside a split embedding would compute half the logits.
    for r in results:
        message = r["conflicting_tied_plan"]
        assert "tied parameters" in message and "different TP layouts" in message, message


def test_replicated_module_on_split_activations_is_caught(results):
    for r in results:
        message = r["dropped_norms"]
        assert "model.layers.0.self_attn.q_norm" in message, message
        assert "differs between those ranks" in message and "model.tp_plan" in message, message


def test_classification_heads_keep_their_own_loss(results):
    # Only a vocabulary-parallel LM head gets the vocabulary-parallel loss; a classification
    # head's loss used to be replaced by the causal-LM loss, which raised.
    for r in results:
        assert set(r["classification"]) == {
            "AutoModelForSequenceClassification",
            "AutoModelForTokenClassification",
        }
        assert max(r["classification"].values()) < 1e-6, r["classification"]


def test_residual_dropout_inside_attention_draws_the_shared_mask(results):
    # Note [Residual dropout inside attention]: the TP region used to cover it, so each rank
    # drew its own mask for a replicated activation and the first-use check refused the model.
    from tests.distributed.test_tp_parity import ATOL

    for r in results:
        case = r["residual_dropout"]
        assert case["loss"] < ATOL and case["grads"] < ATOL, case


def test_nested_attention_modules_leave_the_shared_stream_alone(results):
    # Note [Nested attention modules]: two regions ended at one projection, out of order, and
    # left this rank's TP stream in the default generator.
    from tests.distributed.test_tp_parity import ATOL

    for r in results:
        case = r["nested_attention"]
        assert case["loss"] < ATOL and case["grads"] < ATOL, case
