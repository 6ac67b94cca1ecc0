"""SMP's deprecated ``torch.sagemaker.distributed.fsdp`` package (only ``checkpoint`` remains)."""
