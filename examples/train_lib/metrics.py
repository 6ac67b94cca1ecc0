"""What a person watching the run wants: throughput, TFLOPs, memory, logs, TensorBoard, a plot."""

from __future__ import annotations

import json
import os
import resource

import torch


def model_tflops_per_rank(
    config, global_batch: int, seq_len: int, step_time: float, world_size: int
) -> float:
    """Model TFLOPs per rank by the Megatron formula (as SMP's example scripts compute it).

    12 B s L h^2 [ (1 + kv/heads + s/h) + (ffn/h) * experts_per_token * g + V / (2 L h) ], with
    g = 3/2 for gated (SwiGLU) MLPs and 1 otherwise, divided by step time, 1e12 and world size.
    """
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) or heads
    ffn = config.intermediate_size
    experts = getattr(config, "num_experts_per_tok", 1)
    gated = 1.0 if config.model_type == "gpt_neox" else 1.5
    flops = (
        12
        * global_batch
        * seq_len
        * layers
        * h
        * h
        * (
            (1 + kv / heads + seq_len / h)
            + (ffn / h) * experts * gated
            + config.vocab_size / (2 * layers * h)
        )
    )
    return flops / (step_time * 1e12 * world_size)


def memory_gb() -> dict[str, float]:
    """Peak resident host memory of this process, and CUDA peak when on GPU, in GB."""
    out = {"cpu_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if torch.cuda.is_available():
        out["gpu_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


class MetricsWriter:
    """Collects per-step metrics on rank 0; TensorBoard scalars when tensorboard is installed."""

    def __init__(self, output_dir: str, enabled: bool) -> None:
        self.enabled = enabled
        self.output_dir = output_dir
        self.rows: list[dict] = []
        self.tb = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
            except ImportError:
                self.tb = None  # tensorboard is optional

    def log(self, step: int, **values: float) -> None:
        """Records one row (and its TensorBoard scalars)."""
        if not self.enabled:
            return
        self.rows.append({"step": step, **values})
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)

    def close(self, summary: dict) -> str | None:
        """Writes metrics.json and loss_throughput.png; returns the PNG path (None if no
        matplotlib)."""
        if not self.enabled:
            return None
        with open(os.path.join(self.output_dir, "metrics.json"), "w") as f:
            json.dump({"summary": summary, "steps": self.rows}, f, indent=1)
        if self.tb is not None:
            self.tb.close()
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        train = [r for r in self.rows if "train/loss" in r]
        val = [r for r in self.rows if "val/loss" in r]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        ax1.plot([r["step"] for r in train], [r["train/loss"] for r in train], label="train")
        if val:
            ax1.plot(
                [r["step"] for r in val], [r["val/loss"] for r in val], "o-", label="validation"
            )
        ax1.set(xlabel="step", ylabel="loss (nats/byte)", title="Loss")
        ax1.legend()
        ax2.plot([r["step"] for r in train], [r["perf/tokens_per_s"] for r in train])
        ax2.set(xlabel="step", ylabel="tokens/s (all ranks)", title="Throughput")
        fig.suptitle(summary.get("title", ""))
        fig.tight_layout()
        path = os.path.join(self.output_dir, "loss_throughput.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        return path
