#!/usr/bin/env bash
# torchrun across nodes, with c10d rendezvous and automatic restarts (docs/launch.md).
# Run the same command on every node, for example from a job scheduler:
#
#   MASTER_ADDR=node1 NNODES=2 NPROC_PER_NODE=8 examples/launch/torchrun_multinode.sh
#
# A rank that dies makes torchrun restart every node's ranks (at most MAX_RESTARTS times);
# --resume auto then continues from the newest complete checkpoint in CHECKPOINT_DIR, which
# must be on storage every node sees (FSx, EFS, NFS). Extra arguments go to train.py.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the node that hosts the rendezvous}"
here=$(cd "$(dirname "$0")" && pwd)
# Each restart gets a fresh TCPStore: a shared one keeps the failed attempt's keys, which the
# restarted ranks would read (docs/launch.md, "Surviving a lost host").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec torchrun \
  --nnodes "${NNODES:-2}" \
  --nproc-per-node "${NPROC_PER_NODE:-8}" \
  --rdzv-backend c10d \
  --rdzv-endpoint "${MASTER_ADDR}:${RDZV_PORT:-29400}" \
  --rdzv-id "${JOB_ID:-tsm-job}" \
  --max-restarts "${MAX_RESTARTS:-3}" \
  "$here/../train.py" \
  --smp-config "${SMP_CONFIG:-$here/../configs/hybrid.json}" \
  --checkpoint-dir "${CHECKPOINT_DIR:-checkpoints}" \
  --checkpoint-freq "${CHECKPOINT_FREQ:-50}" \
  --resume auto \
  "$@"
