"""The built extension links the process's shared libstdc++, not a private copy of it.

Note [One libstdc++] in setup.py: a static libstdc++ inside ``torch_sagemaker._C`` has
its own stream and locale state, and on a GCC 13 machine the first error message that
formatted an integer crashed the process. The symbols below are libstdc++'s own (the stream
insertion of a ``long``, the stream initializer, the classic locale): a library that
defines them carries a copy.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from torch_sagemaker.smddp import backend

LIBSTDCXX_OWN = (
    "_ZNSo9_M_insertIlEERSoT_",  # std::ostream::_M_insert<long>
    "_ZNSt8ios_base4InitC1Ev",  # std::ios_base::Init::Init()
    "_ZNSt6locale7classicEv",  # std::locale::classic()
)


@pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built")
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_extension_defines_no_libstdcxx_symbols():
    from torch_sagemaker import _C

    out = subprocess.run(
        ["nm", "--defined-only", _C.__file__],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    defined = {line.split()[-1] for line in out.splitlines() if line.strip()}
    carried = sorted(defined.intersection(LIBSTDCXX_OWN))
    assert not carried, f"{_C.__file__} carries its own libstdc++: defines {carried}"
