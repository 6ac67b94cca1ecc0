#!/usr/bin/env bash
# OpenMPI's mpirun, as SageMaker's smdistributed and pytorchddp launchers start jobs
# (docs/launch.md). Ranks read OMPI_COMM_WORLD_*; no RANK or WORLD_SIZE is needed.
#
#   HOSTS=node1:8,node2:8 examples/launch/mpirun.sh
#
# OpenMPI does not tell a rank where rank 0 runs, so MASTER_ADDR (default: the first host of
# HOSTS) is passed to every rank with -x; a job on one host needs none. Extra arguments go
# to train.py.
set -euo pipefail
HOSTS=${HOSTS:-localhost:2}
first_host=${HOSTS%%,*}
export MASTER_ADDR=${MASTER_ADDR:-${first_host%%:*}}
export MASTER_PORT=${MASTER_PORT:-29500}
np=0
IFS=, read -ra entries <<< "$HOSTS"
for entry in "${entries[@]}"; do np=$((np + ${entry##*:})); done
here=$(cd "$(dirname "$0")" && pwd)
exec mpirun -np "$np" -H "$HOSTS" --bind-to none --map-by slot \
  -x MASTER_ADDR -x MASTER_PORT -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH \
  python "$here/../train.py" \
  --smp-config "${SMP_CONFIG:-$here/../configs/hybrid.json}" \
  "$@"
