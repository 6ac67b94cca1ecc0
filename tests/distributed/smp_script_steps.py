"""The calls SMP's example training scripts make, in their order and spelling, for the tests.

SMP's public example scripts (train_lib.py, checkpoints.py, fsdp_utils.py, train_utils.py)
are the compatibility target. These helpers make the same library calls with the same
argument names, on a tiny Llama and CPU ranks: ``tsm.init()`` reading
``SM_HP_MP_PARAMETERS``, the model built under ``init_empty_weights`` and transformed,
``DelayedParamIniter`` feeding FSDP1's ``param_init_fn``/``post_param_init_fn``, FSDP1 with
``use_orig_params=True`` and an auto-wrap policy on ``TransformerLayer``, bf16 mixed
precision with fp32 buffers, reentrant activation checkpointing on ``TransformerLayer``,
PyTorch's ``offload_wrapper`` import path, the sharded checkpoint types with their directory
layouts, and the ``local`` type (PyTorch's ``LOCAL_STATE_DICT``). Only what CPU needs differs:
``device_id`` is the CPU and ``FullStateDictConfig(offload_to_cpu=False)``.
"""

from __future__ import annotations

import functools
import os

import torch

from tests.distributed.hf_models import VOCAB, global_batches, rank_slice

SEQ = 16
GLOBAL_BATCH = 8


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        use_cache=False,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        attn_implementation="sdpa",
    )


def build_model(delayed: bool = True, moe: bool = False):
    """``(model, initer)`` as train_lib builds them before FSDP (delayed_param=1 by default).

    ``moe=True``: a Mixtral with ``MoEConfig`` built from the scripts' default arguments, and,
    as in the scripts, ``transform`` itself under ``init_empty_weights`` for delayed init.
    """
    import contextlib

    import torch.sagemaker as tsm
    from accelerate import init_empty_weights
    from torch.sagemaker.delayed_param import DelayedParamIniter
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = mixtral_config() if moe else llama_config()
    with init_empty_weights() if delayed else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config)
    moe_config = None
    if moe:
        from torch.sagemaker.moe.moe_config import MoEConfig

        moe_config = MoEConfig(
            smp_moe=True,
            moe_load_balancing="sinkhorn",
            global_token_shuffle=False,
            moe_all_to_all_dispatcher=True,
            use_cpu_initialization=False,
        )
    with init_empty_weights() if (moe and delayed) else contextlib.nullcontext():
        model = tsm.transform(
            model, config=moe_config, load_state_dict_from_rank0=False, cp_comm_type="p2p"
        )
    return model, (DelayedParamIniter(model) if delayed else None)


def wrap_fsdp1(model, initer, bf16: bool = True):
    """FSDP1 exactly as train_lib constructs it, then checkpointing and offloading."""
    import torch.sagemaker as tsm
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch.sagemaker.tensor_parallel.transformer import TransformerLayer

    policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer}
    )
    mixed = (
        MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.float32
        )
        if bf16
        else None
    )
    validate = initer.validate_params_and_buffers_inited() if initer else _Nothing()
    with validate:
        model = FSDP(
            model,
            auto_wrap_policy=policy,
            mixed_precision=mixed,
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            forward_prefetch=True,
            limit_all_gathers=True,
            device_id=torch.device("cpu"),
            use_orig_params=True,
            param_init_fn=initer.get_param_init_fn() if initer else None,
            post_param_init_fn=initer.get_post_param_init_fn() if initer else None,
            sync_module_states=False,
        )
    import torch.distributed as dist

    dist.barrier()
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT
        ),
        check_fn=lambda m: isinstance(m, TransformerLayer),
    )
    if tsm.state.sm_activation_offloading:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

        model = offload_wrapper(model)
    return model


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class DecayingLR:
    """The contract of the scripts' ``AnnealingLR``: ``step()`` sets the learning rate, and
    ``load_state_dict`` re-applies it (the async_local type restores the LR only this way)."""

    def __init__(self, optimizer, base_lr: float) -> None:
        self.optimizer, self.base_lr, self.num_iters = optimizer, base_lr, 0
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr / (1 + self.num_iters)

    def step(self) -> None:
        self.num_iters += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"num_iters": self.num_iters, "base_lr": self.base_lr}

    def load_state_dict(self, state: dict) -> None:
        self.num_iters, self.base_lr = state["num_iters"], state["base_lr"]
        self._apply()


def optimizer_and_scheduler(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.2)
    return optimizer, DecayingLR(optimizer, 1e-2)


def pg_metadata(model):
    """``checkpointing_pg_metadata`` as train_lib computes it."""
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.sagemaker.utils.process_group_utils import get_global_ranks

    return (
        model.process_group,
        min(get_global_ranks(model.process_group)),
        tsm.state.ranker.get_rep_rank(dist.get_rank()) == 0,
    )


def batch_for(step: int) -> torch.Tensor:
    """This rank's rows of global batch ``step`` (data-parallel rank = rank // (tp * cp))."""
    import torch.distributed as dist
    import torch.sagemaker as tsm

    tp_cp = tsm.state.tensor_parallel_degree * tsm.state.context_parallel_degree
    batch = global_batches(step + 1, GLOBAL_BATCH)[step]
    return rank_slice(batch, dist.get_rank() // tp_cp, dist.get_world_size() // tp_cp)


def train_step(model, optimizer, scheduler, step: int) -> float:
    from torch.sagemaker.grad_norm import clip_grad_norm_

    ids = batch_for(step)
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=None, labels=ids)["loss"]
    loss.backward()
    clip_grad_norm_(model, 1.0)
    optimizer.step()
    scheduler.step()
    return loss.item()


def tp_subdir(path: str) -> str:
    """The per-TP-rank (and per-EP-rank) directory of the sharded types."""
    import torch.sagemaker as tsm

    tp, ep = tsm.state.tensor_parallel_degree, tsm.state.expert_parallel_degree
    if tp > 1:
        path = os.path.join(path, f"tp{tp}-{tsm.state.tp_rank}")
    if ep > 1:
        path = os.path.join(path, f"ep{ep}-{tsm.state.ep_rank}")
    return path


# ------------------------------------------------------------------ checkpoint type "sharded"
def save_sharded(model, optimizer, scheduler, path, meta, user):
    from torch.distributed import checkpoint
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {
            "model": model.state_dict(),
            "optimizer": FSDP.optim_state_dict(model, optimizer),
            "scheduler": scheduler.state_dict(),
        } | user
    process_group, coordinator_rank, action_rank = meta
    if action_rank:
        checkpoint.save_state_dict(
            state_dict=state_dict,
            storage_writer=checkpoint.FileSystemWriter(tp_subdir(path)),
            planner=checkpoint.DefaultSavePlanner(),
            process_group=process_group,
            coordinator_rank=coordinator_rank,
        )


def save_sharded_s3(model, optimizer, scheduler, path, meta, user):
    """The ``sharded`` type with an ``s3://`` checkpoint_dir (SMP 2.5+): the same state dict,
    written by ``state_dict_saver.save`` with the URI instead of DCP's file-system writer."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.sagemaker.distributed.checkpoint.state_dict_saver import save

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {
            "model": model.state_dict(),
            "optimizer": FSDP.optim_state_dict(model, optimizer),
            "scheduler": scheduler.state_dict(),
        } | user
    process_group, coordinator_rank, action_rank = meta
    if action_rank:
        save(
            state_dict,
            checkpoint_id=tp_subdir(path),
            process_group=process_group,
            coordinator_rank=coordinator_rank,
        )


def _load_sharded_with(load_fn, reader, model, optimizer, scheduler, path, meta):
    from torch.distributed import checkpoint
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.api import ShardedOptimStateDictConfig

    process_group, coordinator_rank, _ = meta
    directory = tp_subdir(path)
    with FSDP.state_dict_type(
        model,
        StateDictType.SHARDED_STATE_DICT,
        optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=True),
    ):
        state_dict = {
            "model": model.state_dict(),
            "scheduler": scheduler.state_dict(),
            "total_steps": 0,
        }
        load_fn(
            state_dict=state_dict,
            storage_reader=reader(directory),
            process_group=process_group,
            coordinator_rank=coordinator_rank,
            planner=checkpoint.DefaultLoadPlanner(),
        )
        model.load_state_dict(state_dict["model"])
        scheduler.load_state_dict(state_dict["scheduler"])
        optim_state = load_sharded_optimizer_state_dict(
            model_state_dict=state_dict["model"],
            optimizer_key="optimizer",
            storage_reader=reader(directory),
            process_group=model.process_group,
        )
        flattened = FSDP.optim_state_dict_to_load(
            model=model, optim=optimizer, optim_state_dict=optim_state["optimizer"]
        )
        optimizer.load_state_dict(flattened)
    return state_dict["total_steps"]


def load_sharded(model, optimizer, scheduler, path, meta):
    from torch.distributed import checkpoint

    return _load_sharded_with(
        checkpoint.load_state_dict,
        checkpoint.FileSystemReader,
        model,
        optimizer,
        scheduler,
        path,
        meta,
    )


# ------------------------------------------------------------ checkpoint type "async_sharded"
def save_async_sharded(model, optimizer, scheduler, path, meta, user, queue):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.sagemaker.distributed.checkpoint.state_dict_saver import async_save

    process_group, coordinator_rank, action_rank = meta
    queue.maybe_finalize_async_calls(blocking=True, process_group=process_group)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {
            "model": model.state_dict(),
            "optimizer": FSDP.optim_state_dict(model, optimizer),
            "scheduler": scheduler.state_dict(),
        } | user
    if action_rank:
        async_save(
            state_dict,
            checkpoint_id=tp_subdir(path),
            process_group=process_group,
            coordinator_rank=coordinator_rank,
            queue=queue,
        )


def load_async_sharded(model, optimizer, scheduler, path, meta):
    from torch.sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemReader
    from torch.sagemaker.distributed.checkpoint.state_dict_loader import load

    return _load_sharded_with(
        load, DistributedFileSystemReader, model, optimizer, scheduler, path, meta
    )


# -------------------------------------------------------------- checkpoint type "async_local"
def replication_group():
    """``(ranks, group)`` of this rank's replication group, creating one group per rep group."""
    import torch.distributed as dist
    import torch.sagemaker as tsm

    mine = None
    for ranks in tsm.state.ranker.get_rep_groups():
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = (ranks, group)
    return mine


def local_dir(model, path):
    import torch.sagemaker as tsm

    return os.path.join(path, f"tp{tsm.state.tp_rank}_ep{tsm.state.ep_rank}_fsdp{model.rank}")


def save_async_local(model, optimizer, scheduler, path, user, queue, rep):
    from torch.sagemaker.distributed.checkpoint.state_dict_saver import async_save
    from torch.sagemaker.distributed.checkpoint.state_dict_utils import (
        SMStateDictType,
        sm_state_dict_type,
    )

    ranks, group = rep
    queue.maybe_finalize_async_calls(blocking=True, process_group=group)
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state_dict = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        } | user
    async_save(
        state_dict,
        checkpoint_id=local_dir(model, path),
        process_group=group,
        coordinator_rank=min(ranks),
        queue=queue,
    )


def load_async_local(model, optimizer, scheduler, path, rep):
    from pathlib import Path

    from torch.sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemReader
    from torch.sagemaker.distributed.checkpoint.state_dict_loader import load
    from torch.sagemaker.distributed.checkpoint.state_dict_utils import (
        SMStateDictType,
        init_optim_state,
        sm_state_dict_type,
    )

    ranks, group = rep
    reader = DistributedFileSystemReader(Path(local_dir(model, path)))
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state_dict = {
            "model": model.state_dict(),
            "scheduler": scheduler.state_dict(),
            "total_steps": 0,
        }
        init_optim_state(optimizer, skip_empty_param=True)
        state_dict["optimizer"] = optimizer.state_dict()
        load(
            state_dict=state_dict,
            process_group=group,
            coordinator_rank=min(ranks),
            storage_reader=reader,
        )
    scheduler.load_state_dict(state_dict["scheduler"])
    return state_dict["total_steps"]


# -------------------------------------------------------------------- checkpoint type "local"
def save_local(model, optimizer, scheduler, path, user):
    """PyTorch's ``LOCAL_STATE_DICT``: each rank ``torch.save``s its own ``{rank}.pt``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    os.makedirs(path, exist_ok=True)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state_dict = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        } | user
    torch.save(state_dict, os.path.join(path, f"{dist.get_rank()}.pt"))


def load_local(model, optimizer, scheduler, path):
    """Reads this rank's ``{rank}.pt`` back under the FSDP shard group, then loads it.

    The scripts call ``torch.load`` with its default, which became ``weights_only=True`` in
    PyTorch 2.6 and refuses their files (``ShardedTensor``, the model config); on such
    versions users set ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, which this spells out.
    """
    import torch.distributed as dist
    from torch.distributed._shard.api import load_with_process_group
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with load_with_process_group(model.process_group):
        state_dict = torch.load(os.path.join(path, f"{dist.get_rank()}.pt"), weights_only=False)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        model.load_state_dict(state_dict["model"])
        scheduler.load_state_dict(state_dict["scheduler"])
        optimizer.load_state_dict(state_dict["optimizer"])
    return state_dict["total_steps"]


# ---------------------------------------------- checkpoint type "use_pg_with_util" (SMP 2.5.0)
def _fsdp_checkpoint_module():
    import importlib
    import warnings

    with warnings.catch_warnings():  # deprecated in SMP 2.6.1; the 2.5.0 scripts import it
        warnings.simplefilter("ignore", FutureWarning)
        return importlib.import_module("torch.sagemaker.distributed.fsdp.checkpoint")


def save_with_util(model, optimizer, scheduler, path, meta, user):
    import torch.distributed as dist
    from torch.distributed.fsdp import ShardingStrategy, StateDictType

    _fsdp_checkpoint_module().save_model_checkpoint(
        model,
        StateDictType.SHARDED_STATE_DICT,
        path,
        ShardingStrategy.HYBRID_SHARD,
        meta,
        log=dist.get_rank() == 0,
        optimizer=optimizer,
        scheduler=scheduler,
        extra_exports=user,
    )


def load_with_util(model, optimizer, scheduler, path, meta):
    import torch.distributed as dist
    from torch.distributed.fsdp import ShardingStrategy, StateDictType

    util = _fsdp_checkpoint_module()
    loaded = util.load_model_checkpoint(
        model,
        StateDictType.SHARDED_STATE_DICT,
        path,
        ShardingStrategy.HYBRID_SHARD,
        meta,
        log=dist.get_rank() == 0,
        optimizer=optimizer,
        scheduler=scheduler,
        extra_imports={"total_steps": 0},
    )
    assert loaded[util.EXPORT_KEY_MODEL] is model and loaded[util.EXPORT_KEY_OPTIMIZER] is optimizer
    return loaded[util.EXPORT_KEY_IDENTITY]["total_steps"]


def save_full(model, save_dir, config=None):
    """``--save_final_model``: a full state dict on rank 0, ``pytorch_model.bin`` + config."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.api import FullStateDictConfig

    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=True, offload_to_cpu=False),
    ):
        state_dict = model.state_dict()
        if dist.get_rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state_dict, os.path.join(save_dir, "pytorch_model.bin"))
            (config or llama_config()).save_pretrained(save_dir)
        dist.barrier()
    return state_dict
