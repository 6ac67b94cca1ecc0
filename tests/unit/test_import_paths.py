"""``import torch.sagemaker`` and the SMDDP shim, in fresh interpreters, editable and wheel
installs."""

import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECK = """
import sys
# An SMP path that re-exports, as the process's first import of the package.
from torch.sagemaker.distributed.checkpoint.state_dict_loader import load
import torch_sagemaker.checkpoint.state_dict_loader
assert load is torch_sagemaker.checkpoint.state_dict_loader.load
import torch.sagemaker as tsm
from torch.sagemaker import state, transform
import torch.sagemaker.config, torch_sagemaker.config
assert torch.sagemaker.config is torch_sagemaker.config, "module imported twice"
assert tsm.state is state and callable(transform)
# As SMP's documentation and our README write it, with no import of the submodule.
assert callable(tsm.grad_norm.clip_grad_norm_)
import torch_sagemaker.policies
assert 'policies' not in sys.modules, "policies must not be a top-level package"
import smdistributed.dataparallel.torch.torch_smddp
import torch.distributed as dist
assert 'smddp' in dist.Backend.backend_list
print(tsm.__version__, tsm.__file__)
"""


# From the wheel, without the checkout: the planner and its cost model import, and its
# command line points ``validate`` at the benchmarks instead of importing them.
WHEEL_CHECK = """
import importlib.util
assert importlib.util.find_spec("benchmarks") is None and importlib.util.find_spec("tools") is None
from torch_sagemaker.planner import comm, cost_model, plan
from torch_sagemaker.planner.cli import main
assert main(["validate", "time"]) == 2
"""


def _run(args, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)


def test_fresh_interpreter_editable_install(tmp_path):
    # Run from an unrelated directory so the repository is not on sys.path.
    result = _run([sys.executable, "-c", CHECK], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    version, path = result.stdout.split()
    assert version == __import__("torch_sagemaker").__version__


def test_version_one_liner(tmp_path):
    result = _run(
        [sys.executable, "-c", "import torch.sagemaker as tsm; print(tsm.__version__)"],
        cwd=tmp_path,
    )
    from importlib.metadata import version

    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.strip()
        == version("torch_sagemaker")
        == __import__("torch_sagemaker").__version__
    )


@pytest.mark.slow
def test_wheel_install(tmp_path):
    """Builds the regular wheel and imports from it with the editable install switched off."""
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    build = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheel_dir),
            ROOT,
        ]
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = wheel_dir.iterdir()
    names = zipfile.ZipFile(wheel).namelist()
    assert "torch_sagemaker.pth" in names and "_torch_sagemaker_alias.py" in names
    assert "torch_sagemaker/policies/__init__.py" in names
    # The packages by concern, and SMP's paths that re-export them.
    assert {
        "torch_sagemaker/smddp/backend.py",
        "torch_sagemaker/mesh.py",
        "torch_sagemaker/launch_env.py",
        "torch_sagemaker/checkpoint/state_dict_saver.py",
        "torch_sagemaker/checkpoint/utils.py",
        "torch_sagemaker/distributed/checkpoint/state_dict_saver.py",
        "torch_sagemaker/distributed/fsdp/checkpoint.py",
        "torch_sagemaker/state_handler.py",
    } <= set(names)
    assert not any(n.startswith("policies/") for n in names)
    assert any(n.startswith("torch_sagemaker/_C") and n.endswith(".so") for n in names)
    assert "torch_sagemaker/_C.pyi" in names and "torch_sagemaker/py.typed" in names
    # The library only: benchmarks/, tools/ (simulators, lab peers) and tests/ stay in the checkout.
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {
        "torch_sagemaker",
        "smdistributed",
        "_torch_sagemaker_alias.py",
        "torch_sagemaker.pth",
    }
    assert not any(n.startswith("torch_sagemaker/bench/") for n in names)
    assert "torch_sagemaker/planner/cost_model.py" in names  # the planner's own cost model
    install = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ]
    )
    assert install.returncode == 0, install.stderr
    # -S: skip site processing (so the editable install's .pth files are not read); then make
    # the wheel's folder a site dir (its .pth installs the alias) and append the venv's
    # site-packages for torch only.
    bootstrap = (
        f"import site, sys; site.addsitedir({str(target)!r}); "
        f"sys.path.append({sysconfig.get_paths()['purelib']!r});\n" + CHECK + WHEEL_CHECK
    )
    result = _run([sys.executable, "-S", "-c", bootstrap], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[1].startswith(str(target))
