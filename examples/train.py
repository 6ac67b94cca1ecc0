"""Train a Hugging Face causal LM with torch.sagemaker (SMP v2 API) — the project's main job.

    torchrun --standalone --nproc_per_node 2 examples/train.py \
        --smp-config examples/configs/full_shard.json

Flow (as in SMP's example scripts): arguments -> process group -> tsm.init -> model from a
Hugging Face config -> tsm.transform (tensor parallelism) -> FSDP (sharding follows
hybrid_shard_degree) with delayed init -> activation checkpointing -> activation
offloading -> optimizer and LR schedule -> resume -> train with validation and
checkpoints -> Hugging Face export. See examples/README.md for every option.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.sagemaker as tsm  # noqa: E402
from torch.sagemaker.fp8 import DelayedScaling, Format, Fp8Linear, fp8_autocast  # noqa: E402
from torch.sagemaker.grad_norm import clip_grad_norm_  # noqa: E402
from torch.sagemaker.moe import set_aux_loss_scale  # noqa: E402
from train_lib import checkpoints, data, metrics  # noqa: E402
from train_lib.arguments import parse_args, smp_config  # noqa: E402
from train_lib.model import build_config, build_model, moe_config  # noqa: E402
from train_lib.parallel import apply_parallelism, fsdp2_root  # noqa: E402
from train_lib.schedule import param_groups, warmup_cosine  # noqa: E402


def rank0_print(*values) -> None:
    if dist.get_rank() == 0:
        print(*values, flush=True)


def evaluate(model, loader, max_batches: int) -> float:
    """Mean validation loss over ``max_batches`` batches, averaged over data-parallel ranks."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i >= max_batches:
                break
            batch = data.batch_for_cp_rank(batch)
            total += float(model(input_ids=batch, attention_mask=None, labels=batch).loss)
            count += 1
    model.train()
    # On the device the losses live on: NCCL takes only CUDA tensors.
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    )
    stats = torch.tensor([total, count], dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # 1. Process group on the chosen backend, then SMP.
    if args.distributed_backend == "smddp":
        import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  (registers "smddp")
    dist.init_process_group(args.distributed_backend, timeout=datetime.timedelta(minutes=30))
    tsm.init(smp_config(args))
    state = tsm.state
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    rank0_print(
        f"[train] {args.model_type} on {state.world_size} ranks over {dist.get_backend()}: "
        f"dp={state.dp_size} tp={state.tp_size} cp={state.cp_size} "
        f"hybrid_shard_degree={state.hybrid_shard_degree}" + (", fp8" if args.fp8 else "")
    )

    # 2. Data: every rank of a TP x CP group reads the same batch (DistributedSampler over dp);
    #    with context parallelism each rank then keeps its part of every sequence.
    train_set, val_set = data.build_datasets(
        args.dataset,
        args.max_context_width,
        args.corpus_mb,
        args.data_path,
        num_synthetic=args.max_steps * args.train_batch_size * state.dp_size,
    )
    sampler = torch.utils.data.DistributedSampler(
        train_set,
        num_replicas=state.dp_size,
        rank=state.dp_rank,
        shuffle=True,
        seed=args.seed,
        drop_last=True,
    )
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.train_batch_size, sampler=sampler, drop_last=True
    )
    val_loader = None
    if val_set is not None and args.validation_freq:
        val_sampler = torch.utils.data.DistributedSampler(
            val_set, num_replicas=state.dp_size, rank=state.dp_rank, shuffle=False, drop_last=True
        )
        val_loader = torch.utils.data.DataLoader(
            val_set, batch_size=args.val_batch_size, sampler=val_sampler
        )

    # 3. Model -> transform -> FSDP (+ delayed init) -> checkpointing -> offloading.
    config = build_config(args)
    with torch.device("meta") if args.delayed_param else contextlib.nullcontext():
        model = build_model(config)
    num_params = sum(p.numel() for p in model.parameters())  # before sharding (works on meta too)
    model = tsm.transform(
        model,
        config=moe_config(args),  # MoEConfig with --moe 1
        cp_comm_type=args.cp_comm_type,
    )
    model = apply_parallelism(model, args, dtype)
    optimizer = torch.optim.AdamW(
        param_groups(model, args.weight_decay), lr=args.lr, betas=(args.beta1, args.beta2)
    )
    scheduler = warmup_cosine(optimizer, args.max_steps, args.warmup, args.lr, args.min_lr)
    train_state = checkpoints.TrainingState(model, optimizer, scheduler)  # step 0
    if args.resume_from_checkpoint:
        path = checkpoints.resume(train_state, args.checkpoint_dir, args.resume_from_checkpoint)
        rank0_print(
            f"[train] resumed from {path} at step {train_state.step}"
            if path
            else "[train] no checkpoint to resume from; starting at step 0"
        )

    # FP8 as SMP's scripts enable it: the recipe here, the forward under fp8_autocast below.
    fp8_recipe = None
    if args.fp8:
        fp8_recipe = DelayedScaling(
            fp8_format=Format.HYBRID,
            amax_history_len=args.fp8_amax_history_len,
            amax_compute_algo=args.fp8_amax_compute_algo,
        )
        layers = sum(isinstance(m, Fp8Linear) for m in model.modules())
        rank0_print(f"[train] FP8: {layers} linear layers per rank under {fp8_recipe}")

    # 4. Train.
    # The MoE layers' auxiliary losses are divided as the loss is (1 without accumulation).
    set_aux_loss_scale(1 / args.gradient_accumulation_steps)
    accumulating = fsdp2_root(model) if args.gradient_accumulation_steps > 1 else None
    if args.gradient_accumulation_steps > 1:
        rank0_print(
            f"[train] gradient accumulation: {args.gradient_accumulation_steps} micro-batches "
            f"of {args.train_batch_size // args.gradient_accumulation_steps} sequences a step"
        )
    writer = metrics.MetricsWriter(args.output_dir, enabled=dist.get_rank() == 0)
    global_batch = args.train_batch_size * state.dp_size
    steps_per_epoch = len(loader)
    progress = None
    if args.progress and dist.get_rank() == 0:
        from tqdm import tqdm

        progress = tqdm(
            total=args.max_steps,
            initial=train_state.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stdout,
        )
    auto = checkpoints.AutoInterval() if args.checkpoint_freq == "auto" else None

    def checkpoint_due(step: int, step_time: float) -> bool:
        if auto is not None:
            return auto.due(step, step_time)
        return bool(args.checkpoint_freq) and step % args.checkpoint_freq == 0

    losses, step_times, start = [], [], time.perf_counter()
    last_step = min(args.max_steps, args.stop_at_step or args.max_steps)
    while train_state.step < last_step:
        epoch, offset = divmod(train_state.step, steps_per_epoch)
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i < offset:
                continue  # resumed mid-epoch: skip what the run before already consumed
            if train_state.step >= last_step:
                break
            t0 = time.perf_counter()
            batch = data.batch_for_cp_rank(batch)  # whole sequences unless cp > 1
            # Gradient accumulation: a forward and backward per micro-batch, the loss divided
            # by their number; FSDP2 all-reduces over its replicas after the last only.
            micro_batches = batch.chunk(args.gradient_accumulation_steps)
            parts = []
            for j, micro in enumerate(micro_batches):
                if accumulating is not None:
                    accumulating.set_requires_all_reduce(j == len(micro_batches) - 1)
                with fp8_autocast(
                    enabled=args.fp8, fp8_recipe=fp8_recipe, fp8_group=state.world_process_group
                ):
                    micro_loss = model(
                        input_ids=micro, attention_mask=None, labels=micro
                    ).loss / len(micro_batches)  # bf16 via FSDP MP
                micro_loss.backward()
                parts.append(micro_loss.detach().float())
            grad_norm = clip_grad_norm_(model, args.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            train_state.step += 1
            step = train_state.step
            reduced = torch.stack(parts).sum()
            dist.all_reduce(reduced)
            reduced = reduced.item() / dist.get_world_size()
            step_time = time.perf_counter() - t0
            losses.append(reduced)
            step_times.append(step_time)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{reduced:.3f}")
            if step % args.logging_freq == 0 or step == args.max_steps:
                tflops = metrics.model_tflops_per_rank(
                    config, global_batch, args.max_context_width, step_time, state.world_size
                )
                row = {
                    "train/loss": reduced,
                    "perf/samples_per_s": global_batch / step_time,
                    "perf/tokens_per_s": global_batch * args.max_context_width / step_time,
                    "perf/model_tflops_per_rank": tflops,
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm),
                    **metrics.memory_gb(),
                }
                writer.log(step, **row)
                rank0_print(
                    f"[train] step {step}: loss {reduced:.4f}, "
                    f"{row['perf/samples_per_s']:.1f} samples/s, "
                    f"{row['perf/tokens_per_s']:.0f} tokens/s, {tflops:.4f} model TFLOPs/rank, "
                    f"lr {row['lr']:.2e}, grad norm {row['grad_norm']:.3f}, "
                    f"peak mem {row['cpu_peak_gb']:.2f} GB" + offload_note(model, args)
                )
            if val_loader is not None and step % args.validation_freq == 0:
                val = evaluate(model, val_loader, args.validation_batches)
                writer.log(step, **{"val/loss": val, "val/perplexity": math.exp(val)})
                rank0_print(
                    f"[train] step {step}: validation loss {val:.4f}, "
                    f"perplexity {math.exp(val):.2f}"
                )
            if args.checkpoint_dir and checkpoint_due(step, step_time):
                t_save = time.perf_counter()
                path = checkpoints.save(
                    train_state,
                    args.checkpoint_dir,
                    args.model_type,
                    args.num_kept_checkpoints,
                    args.checkpoint_type == "async_sharded",
                )
                rank0_print(f"[train] step {step}: checkpoint {path}")
                if auto is not None and auto.measuring:
                    save_s = time.perf_counter() - t_save
                    checkpoints.finish()  # once, to time the background write
                    io_s = time.perf_counter() - t_save - save_s
                    interval = auto.measured(step_time, save_s, io_s)
                    rank0_print(
                        f"[train] auto checkpoint interval: {interval} steps (step "
                        f"{step_time:.3f} s, save call {save_s:.3f} s, write {io_s:.3f} s)"
                    )
    if progress is not None:
        progress.close()
    checkpoints.finish()

    # 5. Export and summary.
    if args.export_dir:
        from torch.sagemaker.distributed.checkpoint import save_hf_checkpoint

        save_hf_checkpoint(model, args.export_dir)
        rank0_print(f"[train] exported a Hugging Face model to {args.export_dir}")
    median_step = sorted(step_times)[len(step_times) // 2] if step_times else float("nan")
    summary = {
        "title": f"{args.model_type}, {state.world_size} ranks, {dist.get_backend()}",
        "steps": train_state.step,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "losses": losses,
        "median_step_s": median_step,
        "tokens_per_s": global_batch * args.max_context_width / median_step,
        "minutes": (time.perf_counter() - start) / 60,
        "num_params": num_params,
    }
    plot = writer.close(summary)
    if losses:
        rank0_print(
            f"[train] done: {len(losses)} steps in {summary['minutes']:.1f} min, loss "
            f"{losses[0]:.3f} -> {losses[-1]:.3f}, median step {median_step * 1e3:.0f} ms, "
            f"{summary['tokens_per_s']:.0f} tokens/s" + (f", plot {plot}" if plot else "")
        )
    dist.destroy_process_group()
    return summary


def offload_note(model, args) -> str:
    """Offload statistics of the last step, when SMP's prefetching offloader is on."""
    if not (args.offload_activations and tsm.state.sm_activation_offloading):
        return ""
    from torch.sagemaker.offload import get_stats

    return f", offload: {get_stats(model, reset=True).summary()}"


if __name__ == "__main__":
    main()
