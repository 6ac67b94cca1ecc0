"""SMP's alias path ``torch.sagemaker.state_handler.state``: a re-export of ``tsm.state``.

SMP documents ``torch.sagemaker.state`` and names ``torch.sagemaker.state_handler.state`` as
the same object; the one ``State`` is ``torch_sagemaker.state.state``. Nothing is defined here.
"""

from torch_sagemaker.state import State, state

__all__ = ["State", "state"]
