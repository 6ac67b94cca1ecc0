"""One simulated host of the kill-and-resume test: runs torchrun, and on the chosen host kills
its ranks once, in the middle of training.

``python -m tests.distributed.elastic_host {host} --kill-host K --after-step N --checkpoint-dir
D --record F -- TORCHRUN_ARGS...`` runs ``torchrun TORCHRUN_ARGS`` (netns_hosts substitutes
``{host}``). On host K, as soon as a complete checkpoint of step >= N exists under D, every
worker torchrun started on this host is killed with SIGKILL, as a host whose processes die
would leave them; torchrun's agent is left alive to restart them. ``F`` records the newest
complete checkpoint step seen at that moment. The exit status is torchrun's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

STEP_DIR = re.compile(r"^.*-(\d+)steps$")


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints under ``root`` (examples/train.py's naming)."""
    # Imported here, on the one host that kills: the package imports torch, seconds of CPU
    # that the other host (and both hosts of the uninterrupted run) need not spend.
    from torch_sagemaker.checkpoint import is_complete

    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        match = STEP_DIR.match(name)
        if match and is_complete(os.path.join(root, name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (from /proc; no PID namespace separates the hosts)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # field 4 of stat: the parent's PID
            found.append(int(entry))
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("host", type=int)
    parser.add_argument("--kill-host", type=int, required=True)
    parser.add_argument("--after-step", type=int, required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--record", required=True)
    argv = sys.argv[1:]
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *command])
    if args.host == args.kill_host:
        while agent.poll() is None:
            steps = complete_steps(args.checkpoint_dir)
            if steps and steps[-1] >= args.after_step:
                workers = children(agent.pid)
                for pid in workers:
                    os.kill(pid, signal.SIGKILL)
                with open(args.record, "w") as f:
                    json.dump({"newest_checkpoint": steps[-1], "killed": workers}, f)
                print(f"killed workers {workers} after checkpoint step {steps[-1]}", flush=True)
                break
            time.sleep(0.02)
    return agent.wait()


if __name__ == "__main__":
    sys.exit(main())
