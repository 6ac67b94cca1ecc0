"""Builds torch_sagemaker, its native extension torch_sagemaker._C and the import aliases.

- ``csrc/**/*.cpp`` -> ``torch_sagemaker._C`` (the smddp collective backend), built with
  torch.utils.cpp_extension against the installed torch. Build without isolation
  (``pip install --no-build-isolation``) so the extension matches the torch you run.
- ``smdistributed/`` is the compatibility shim SMP scripts import for the "smddp" backend.
- ``torch_sagemaker.pth`` + ``_torch_sagemaker_alias.py`` make ``import torch.sagemaker``
  work; see that module's docstring. The .pth file is added to both the regular wheel
  (build_py) and the editable wheel (editable_wheel).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import torch
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
PTH_FILE = "torch_sagemaker.pth"


def _version() -> str:
    scope: dict[str, str] = {}
    with open(os.path.join(HERE, "torch_sagemaker", "_version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


class BuildPyWithPth(build_py):
    """Copies the start-up .pth file to the root of the regular wheel."""

    def run(self) -> None:
        super().run()
        shutil.copy(os.path.join(HERE, PTH_FILE), os.path.join(self.build_lib, PTH_FILE))


class EditableWheelWithPth(editable_wheel):
    """Adds the start-up .pth file to the editable wheel as well."""

    def _select_strategy(self, name, tag, build_lib):
        strategy = super()._select_strategy(name, tag, build_lib)

        class _WithPth:
            def __enter__(self):
                strategy.__enter__()
                return self

            def __exit__(self, *exc):
                return strategy.__exit__(*exc)

            def __call__(self, wheel, files, mapping):
                strategy(wheel, files, mapping)
                with open(os.path.join(HERE, PTH_FILE), "rb") as f:
                    wheel.writestr(PTH_FILE, f.read())

        return _WithPth()


def _cxx_standard() -> str:
    """The C++ standard the installed torch's headers need: C++20 from torch 2.14 on."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 14) else "-std=c++17"


class BuildExtensionInTree(BuildExtension):
    """Compiles into ``build/temp`` of the checkout, whoever asks for the build.

    ``pip install -e .`` would otherwise compile in a throw-away folder and a later
    ``setup.py build_ext --inplace`` (``make build``) would compile everything again; with
    one folder, ninja finds the objects of the first build and the second does nothing.
    """

    def finalize_options(self) -> None:
        super().finalize_options()
        self.build_temp = os.path.join(HERE, "build", "temp")

    def build_extensions(self) -> None:
        super().build_extensions()
        for ext in self.extensions:
            _refuse_private_libstdcxx(self.get_ext_fullpath(ext.name))


# Note [One libstdc++]: the extension must use the process's shared libstdc++, the one torch
# uses. A toolchain whose g++ links its own libstdc++ statically (seen: a GCC installed under
# /opt/gcc and named by CXX) puts a second copy in the extension, with its own stream and
# locale state; the first error message that formatted an integer then crashed the process.
# These are libstdc++'s own symbols (the insertion of a long into a stream, the stream
# initializer, the classic locale): a library that defines them carries a copy.
_LIBSTDCXX_OWN = ("_ZNSo9_M_insertIlEERSoT_", "_ZNSt8ios_base4InitC1Ev", "_ZNSt6locale7classicEv")


def _refuse_private_libstdcxx(path: str) -> None:
    """Fails the build, naming the compiler and the fix, if ``path`` carries libstdc++."""
    if not os.path.exists(path) or shutil.which("nm") is None:
        return
    out = subprocess.run(["nm", "--defined-only", path], capture_output=True, text=True).stdout
    carried = sorted(
        {line.split()[-1] for line in out.splitlines() if line.strip()} & set(_LIBSTDCXX_OWN)
    )
    if carried:
        os.remove(path)
        raise RuntimeError(
            f"{path} was linked with its own copy of libstdc++ (it defines {carried}), "
            "which crashes next to torch's. The compiler was "
            f"CXX={os.environ.get('CXX', 'c++')!r}. "
            "Build with the system compiler instead, e.g. CC=gcc CXX=g++ pip install -e ."
        )


csrc_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))

# Python's own compile flags carry -g, so the extension carried 39 MB of debug sections for
# 2 MB of code: a 15.6 MB wheel, 1.4 MB without them, and seconds of linking and zipping on
# every build. The code keeps its symbols (backtraces still name functions); for line
# numbers in a debugger, build with TSM_DEBUG_INFO=1.
_LINK_ARGS = [] if os.environ.get("TSM_DEBUG_INFO") == "1" else ["-Wl,--strip-debug"]

setup(
    name="torch_sagemaker",
    version=_version(),
    description="Open re-implementation of SageMaker model parallelism v2 and SMDDP on PyTorch",
    python_requires=">=3.10",
    packages=find_packages(
        include=["torch_sagemaker", "torch_sagemaker.*", "smdistributed", "smdistributed.*"]
    ),
    py_modules=["_torch_sagemaker_alias"],
    # The extension's type stub and the PEP 561 marker: installed users get the same types as
    # a checkout.
    package_data={"torch_sagemaker": ["_C.pyi", "py.typed"]},
    ext_modules=[
        CppExtension(
            name="torch_sagemaker._C",
            sources=csrc_sources,
            include_dirs=[os.path.join(HERE, "csrc")],
            extra_compile_args=["-O3", _cxx_standard(), "-fvisibility=hidden"],
            extra_link_args=_LINK_ARGS,
        )
    ],
    cmdclass={
        "build_ext": BuildExtensionInTree.with_options(use_ninja=True),
        "build_py": BuildPyWithPth,
        "editable_wheel": EditableWheelWithPth,
    },
    # The tested range (docs/compatibility.md).
    install_requires=["torch>=2.11,<2.16"],
    extras_require={
        "hf": ["transformers>=5", "accelerate", "safetensors"],
        "examples": ["tqdm", "matplotlib"],
        # s3:// checkpoints (save/async_save/load with checkpoint_id="s3://...").
        "s3": ["s3torchconnector[dcp]>=1.5", "boto3"],
        "dev": ["pytest", "pytest-timeout", "ruff", "ninja"],
    },
)
