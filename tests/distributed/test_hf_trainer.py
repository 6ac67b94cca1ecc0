"""Hugging Face's ``Trainer`` on the smddp backend, against the same job on gloo.

A script that creates its group with ``init_process_group("smddp")`` before the ``Trainer``
(accelerate then uses that group; on CPU accelerate would pick gloo itself) trains with DDP
and with the ``fsdp=`` option: the logged losses and the final parameters equal those of
the same job on gloo.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_distributed


def _train(fsdp: bool, tmp: str) -> dict:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    rows = torch.randint(0, 128, (16, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r} for r in rows]
    kwargs: dict = dict(
        output_dir=f"{tmp}/{dist.get_backend()}_{fsdp}",
        per_device_train_batch_size=2,
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    if fsdp:
        kwargs.update(
            fsdp="full_shard auto_wrap",
            fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        )
    trainer = Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if fsdp:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(trainer.model):
            params = {n: p.detach().clone() for n, p in unwrapped.named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in unwrapped.named_parameters()}
    return {"backend": dist.get_backend(), "losses": losses, "params": params}


@pytest.mark.distributed
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_trainer_on_smddp_trains_as_on_gloo(fsdp, tmp_path):
    runs = {
        backend: run_distributed(
            _train, fsdp, str(tmp_path), backend=backend, fresh=True, timeout=300
        )[0]
        for backend in ("smddp", "gloo")
    }
    assert runs["smddp"]["backend"] == "smddp", runs["smddp"]["backend"]
    assert len(runs["smddp"]["losses"]) == 3
    torch.testing.assert_close(runs["smddp"]["losses"], runs["gloo"]["losses"], rtol=0, atol=1e-6)
    for name, value in runs["gloo"]["params"].items():
        torch.testing.assert_close(
            runs["smddp"]["params"][name], value, rtol=0, atol=1e-6, msg=name
        )
