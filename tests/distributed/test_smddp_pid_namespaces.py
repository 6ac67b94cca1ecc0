"""smddp between ranks in separate PID namespaces that share the IPC namespace and /dev/shm
(containers of one pod): they are one host, and a peer's pid, which means nothing in the
other namespace, must not get it declared dead."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Rank 1 waits a second before the all_reduce, so rank 0's wait reaches the periodic check
# of its peers' processes (every 20 ms) many times.
RANK = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    import torch_sagemaker
    from datetime import timedelta
    from torch_sagemaker.smddp.backend import group_layout
    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("smddp", init_method=f"file://{store}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    if rank == 1:
        time.sleep(1.0)
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    import os
    print("RESULT", os.getpid(), group_layout()["hosts"], t.tolist(), flush=True)
    dist.destroy_process_group()
""")


def _unshare_works() -> str:
    if not shutil.which("unshare"):
        return "no unshare(1)"
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "true"],
        capture_output=True,
        text=True,
    )
    return "" if probe.returncode == 0 else probe.stderr.strip()


def test_ranks_in_separate_pid_namespaces_are_one_host_and_not_declared_dead(tmp_path):
    reason = _unshare_works()
    if reason:
        pytest.skip(f"needs Linux user and PID namespaces: {reason}")
    # A file store both namespaces see: a TCP store's port, probed free beforehand, was once
    # taken by another process before rank 0 listened on it (EADDRINUSE).
    store = tmp_path / "store"
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    # In its namespace rank 0 runs as pid 2; rank 1 first forks a few processes, so its pid
    # there (about 10) does not exist in rank 0's namespace.
    shells = [
        f"{sys.executable} {script} 0 {store}",
        f"for i in 1 2 3 4 5 6 7 8; do /bin/true; done; {sys.executable} {script} 1 {store}",
    ]
    procs = [
        subprocess.Popen(
            [
                "unshare",
                "--user",
                "--map-root-user",
                "--pid",
                "--fork",
                "--mount-proc",
                "sh",
                "-c",
                cmd,
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for cmd in shells
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    results = []
    for out in outputs:
        lines = [line.split() for line in out.splitlines() if line.startswith("RESULT")]
        assert lines, out[-4000:]
        results.append(lines[0])
    assert int(results[0][1]) != int(results[1][1])  # really different pids
    for _, _, hosts, *values in results:
        assert hosts == "1"  # shared memory between the namespaces
        assert "".join(values) == "[3.0,3.0,3.0,3.0]"
