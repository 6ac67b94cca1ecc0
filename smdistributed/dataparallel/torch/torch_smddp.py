"""SMP scripts do ``import smdistributed.dataparallel.torch.torch_smddp`` to get backend "smddp".

Importing this module registers torch_sagemaker's native backend under that name, so
``dist.init_process_group("smddp")`` works exactly as in SMP scripts. As with SMDDP under
mpirun, the script needs no ``RANK`` or ``WORLD_SIZE``: the torchrun variables that the
launcher (mpirun, srun, torchrun, SageMaker) implies are exported here where unset, and
``init_process_group``'s ``env://`` reads them (docs/launch.md).
"""

from torch_sagemaker import launch_env
from torch_sagemaker.logger import warn_once
from torch_sagemaker.smddp.backend import register

try:
    launch_env.export_torch_variables()
    launch_env.export_smddp_variables()  # Hugging Face's Trainer reads SMDDP's local rank
except launch_env.LaunchEnvError as error:
    # A script that creates its group with explicit rank and world size is not held to the
    # launcher's variables (tsm.init raises the same error if it has to use them).
    warn_once(
        f"{error} (read when importing torch_smddp; init_process_group('smddp') with "
        "env:// needs these variables)"
    )
if (warning := launch_env.restart_warning()) is not None:
    warn_once(warning)

if not register():
    raise ImportError(
        "the smddp backend is not available: torch_sagemaker._C was built without it. "
        "Reinstall torch_sagemaker with `pip install --no-build-isolation -e .` against your torch."
    )
