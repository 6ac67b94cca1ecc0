"""smddp on a /dev/shm that is (nearly) full, as in a container with a small /dev/shm:
group creation and point-to-point messages raise a clear error instead of dying with
SIGBUS. The ranks run in a mount namespace of their own with a 1 MiB tmpfs on /dev/shm
(``unshare --user --map-root-user --mount``), so the machine's /dev/shm is not touched."""

import os
import shutil
import subprocess
import sys

import pytest

from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_IN_SMALL_SHM = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]


def _unavailable_reason() -> str | None:
    if shutil.which("unshare") is None:
        return "the 'unshare' command is not installed"
    probe = _IN_SMALL_SHM + ["mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make a mount namespace: {e}"
    return None if done.returncode == 0 else f"cannot mount a tmpfs: {done.stderr.strip()}"


@pytest.mark.parametrize("size", ["16k", "1m"])
def test_a_full_dev_shm_raises_instead_of_sigbus(size, tmp_path):
    # Before: the point-to-point region was written without committing its pages, and a
    # rank died with SIGBUS during group creation (16k) or in the send (1m).
    reason = _unavailable_reason()
    if reason:
        pytest.skip(reason)
    # --standalone: torchrun's store listens on a port it chose itself. A port probed here
    # and handed over could be taken in between (the namespace shares the machine's ports):
    # EADDRINUSE in one CI run.
    launch = (
        f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} -m "
        f"torch.distributed.run --standalone --nproc-per-node 2 "
        f"-m tests.distributed.smddp_full_shm_rank {tmp_path}"
    )
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    done = subprocess.run(
        _IN_SMALL_SHM + [launch], capture_output=True, text=True, timeout=180, env=env, cwd=REPO
    )
    output = done.stdout + done.stderr
    assert "SIGBUS" not in output and "Signal 7" not in output, output[-4000:]
    assert done.returncode == 0, output[-4000:]
    seen = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    # Each rank raises: one for the room it lacks, the other for that or for its peer.
    assert all(s.startswith("error") for s in seen), seen
    assert any("/dev/shm has no room" in s for s in seen), seen
