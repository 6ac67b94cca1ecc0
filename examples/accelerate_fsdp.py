"""The same model trained with Hugging Face accelerate's FSDP plugin on the smddp backend.

    accelerate launch --config_file examples/accelerate_fsdp.yaml examples/accelerate_fsdp.py

The process group is created on "smddp" before the ``Accelerator`` (which then uses it) and
``tsm.init`` lays out the ranks. On GPUs accelerate's FSDP plugin (FSDP2, from the YAML file)
wraps the model. accelerate does not offer FSDP for CPU processes (it treats them as
MULTI_CPU, i.e. DDP), so on CPU the model is sharded with ``torch.sagemaker.sharding.shard_model``
(FSDP2 on ``tsm.state``'s mesh) and accelerate prepares the optimizer and the data loader.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.sagemaker as tsm  # noqa: E402
from train_lib import data  # noqa: E402
from train_lib.arguments import parse_args  # noqa: E402
from train_lib.model import build_config, build_model  # noqa: E402

import smdistributed.dataparallel.torch.torch_smddp  # noqa: E402,F401  (registers "smddp")


def main() -> None:
    args = parse_args(sys.argv[1:] + ["--max-steps", os.environ.get("STEPS", "30")])
    dist.init_process_group("smddp", timeout=datetime.timedelta(minutes=10))
    tsm.init({})
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(args.seed)
    model = tsm.transform(build_model(build_config(args)))
    train_set, _ = data.build_datasets("stdlib", args.max_context_width, 1.0, None, 0)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.train_batch_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # replaced after CPU sharding
    if accelerator.distributed_type == DistributedType.FSDP:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        from torch.sagemaker.sharding import shard_model

        model = shard_model(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        optimizer, loader = accelerator.prepare(optimizer, loader)
    accelerator.print(f"[accelerate] model prepared as {type(model).__name__}")
    for step, batch in enumerate(loader, start=1):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            accelerator.print(
                f"[accelerate] step {step}: loss {loss.item():.4f} on backend {dist.get_backend()}"
            )
        if step >= args.max_steps:
            break
    accelerator.end_training()


if __name__ == "__main__":
    main()
