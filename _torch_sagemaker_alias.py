"""Makes ``import torch.sagemaker`` resolve to the ``torch_sagemaker`` package.

SMP v2 scripts import the library as ``torch.sagemaker``; our code lives in the ordinary
package ``torch_sagemaker``. This module is the one place that connects the two names. It
is imported at interpreter start-up by ``torch_sagemaker.pth`` (installed next to it in
site-packages, for normal and editable installs alike) and does nothing but put a meta
path finder first in ``sys.meta_path``; it must stay free of heavy imports (not even
``torch``) because every Python process of the environment runs it.

The finder answers only for ``torch.sagemaker`` and ``torch.sagemaker.<sub>``: it imports
``torch_sagemaker[.<sub>]`` and hands back that very module object, so each module exists
once in ``sys.modules`` under both names and there is a single ``tsm.state``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

_ALIAS = "torch.sagemaker"
_TARGET = "torch_sagemaker"


class _AliasLoader(importlib.abc.Loader):
    """Returns the already-imported real module instead of creating a new one."""

    def __init__(self, real_name: str) -> None:
        self._real_name = real_name

    def create_module(self, spec):  # noqa: D102
        module = importlib.import_module(self._real_name)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:  # noqa: D102
        # The real module was executed by its own import. importlib has just pointed its
        # __spec__ at the alias spec; put the real one back so the module keeps one identity.
        module.__spec__ = self._real_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Maps ``torch.sagemaker[.x]`` onto ``torch_sagemaker[.x]``."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102
        if fullname != _ALIAS and not fullname.startswith(_ALIAS + "."):
            return None
        real_name = _TARGET + fullname[len(_ALIAS) :]
        real_spec = importlib.util.find_spec(real_name)
        if real_spec is None:
            return None
        is_package = real_spec.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(real_name), is_package=is_package
        )


def install() -> None:
    """Adds the finder to ``sys.meta_path`` once (idempotent)."""
    # First in line: the regular path finder would otherwise load ``torch.sagemaker.x`` a
    # second time from ``torch_sagemaker.__path__`` under the alias name.
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


install()
