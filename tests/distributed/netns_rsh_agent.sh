#!/bin/sh
# mpirun's launch agent (in place of ssh) for the simulated hosts of netns_hosts.py:
# `netns_rsh_agent.sh [ssh options] HOST COMMAND...` enters HOST's network, IPC and UTS
# namespaces (by the PID that netns_mpirun.py recorded in $NETNS_PID_DIR/HOST.pid) and runs
# COMMAND there with a shell, as sshd would. SM_CURRENT_HOST is set as in that host's own
# environment on SageMaker (algo-<index + 1>).
while [ $# -gt 0 ]; do
  case "$1" in
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"
shift
pid=$(cat "$NETNS_PID_DIR/$host.pid") || exit 255
index=${host##*.}
exec nsenter --target "$pid" --net --ipc --uts -- env SM_CURRENT_HOST="algo-$index" sh -c "$*"
