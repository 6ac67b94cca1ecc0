"""FP8 training of the linear layers ``tsm.transform`` produced (docs/fp8.md).

SMP v2 trains in FP8 through Transformer Engine; its scripts wrap the forward in
``transformer_engine.pytorch.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling(...),
fp8_group=tsm.state.world_process_group)``. This package gives the same API on plain
PyTorch (``torch.float8_e4m3fn`` / ``float8_e5m2`` and ``torch._scaled_mm``), for the
DTensor tensor parallel path and for models without tensor parallelism::

    from torch.sagemaker.fp8 import DelayedScaling, Format, fp8_autocast

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024,
                            amax_compute_algo="max")
    with fp8_autocast(enabled=True, fp8_recipe=recipe,
                      fp8_group=tsm.state.world_process_group):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()

Modules, one concern each: ``recipe`` (formats, recipes, Transformer Engine's recipe
objects), ``numerics`` (quantization, the scale rules, the FP8 product), ``scaling``
(per-layer state, amax reduction, the delayed update), ``autocast`` (the region),
``linear`` (``Fp8Linear``), ``scaling_state`` (the scaling state as a checkpoint item),
``prepare`` (the step of ``tsm.transform``; internal), ``te_bridge`` (Transformer Engine's
region next to ours).
"""

from __future__ import annotations

from torch_sagemaker.fp8.autocast import autocast, fp8_autocast, get_fp8_recipe, is_fp8_enabled
from torch_sagemaker.fp8.linear import Fp8Linear, to_fp8_linear
from torch_sagemaker.fp8.recipe import DelayedScaling, Float8CurrentScaling, Format
from torch_sagemaker.fp8.scaling_state import load_scaling_state_dict, scaling_state_dict

__all__ = [
    "DelayedScaling",
    "Float8CurrentScaling",
    "Format",
    "Fp8Linear",
    "autocast",
    "fp8_autocast",
    "get_fp8_recipe",
    "is_fp8_enabled",
    "load_scaling_state_dict",
    "scaling_state_dict",
    "to_fp8_linear",
]
