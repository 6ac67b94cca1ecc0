"""SMP scripts do ``import smdistributed.dataparallel.torch.torch_smddp`` to get backend "smddp".

Importing this module registers torch_sagemaker's native backend under that name, so
``dist.init_process_group("smddp")`` works exactly as in SMP scripts.
"""

from torch_sagemaker.distributed.backend import register

if not register():
    raise ImportError(
        "the smddp backend is not available: torch_sagemaker._C was built without it. "
        "Reinstall torch_sagemaker with `pip install --no-build-isolation -e .` against your torch."
    )
