"""Note [Transform under init_empty_weights]: which ``register_parameter`` the TP step uses.

Each case runs in a fresh interpreter, since the package takes PyTorch's method when it is
first imported.
"""

import subprocess
import sys

IMPORTED_FIRST = """
import torch.nn as nn
import torch_sagemaker._transform as t
from accelerate import init_empty_weights
with init_empty_weights():
    patched = nn.Module.register_parameter
    with t._torch_register_parameter():
        assert nn.Module.register_parameter is t._TORCH_REGISTER_PARAMETER
        assert nn.Linear(2, 2).weight.device.type == "cpu"  # PyTorch's: not moved to meta
    assert nn.Module.register_parameter is patched  # the context's is back
with t._torch_register_parameter():  # outside the context: nothing to swap
    assert nn.Module.register_parameter is t._TORCH_REGISTER_PARAMETER
print("ok")
"""

IMPORTED_INSIDE = """
import torch.nn as nn
from accelerate import init_empty_weights
with init_empty_weights():
    import torch_sagemaker._transform as t  # sees accelerate's method, never uses it
    try:
        with t._torch_register_parameter():
            pass
        print("no error")
    except RuntimeError as e:
        print(e)
with t._torch_register_parameter():  # outside: PyTorch's is in place, nothing to do
    assert nn.Linear(2, 2).weight.device.type == "cpu"
"""


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_tp_step_registers_with_pytorchs_method_inside_init_empty_weights():
    assert _run(IMPORTED_FIRST).strip() == "ok"


def test_first_import_inside_init_empty_weights_names_the_fix():
    out = _run(IMPORTED_INSIDE)
    assert "Import torch.sagemaker before entering init_empty_weights()" in out, out
