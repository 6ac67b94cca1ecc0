"""One rank of test_smddp_full_shm: a group over a /dev/shm with almost no room, then a
send of 1.2 MB from rank 0 to rank 1 (more than the room left). Writes what the rank saw,
"ok ..." or "error <message>", to <directory given as argument>/rank<N>.txt."""

import datetime
import os
import sys

import torch
import torch.distributed as dist

import torch_sagemaker.smddp  # noqa: F401  (registers smddp)


def main() -> None:
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.txt"), "w") as out:
        out.write(outcome())


def outcome() -> str:
    try:
        dist.init_process_group("smddp", timeout=datetime.timedelta(seconds=30))
        n = 300_000
        if dist.get_rank() == 0:
            dist.send(torch.ones(n), 1)
            return "ok sent"
        else:
            t = torch.zeros(n)
            dist.recv(t, 0)
            return f"ok received {t.sum().item()}"
    except RuntimeError as e:
        return f"error {e}"


if __name__ == "__main__":
    main()
