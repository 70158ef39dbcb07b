#!/bin/sh
# plm_rsh_agent for mpirun on the rail test bed: host "nodeI" is namespace <prefix>-nI.
# mpirun calls: mpi_agent.sh [ssh options] HOST COMMAND...
prefix=${RW_TESTBED_PREFIX:-rwtb}
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
exec ip netns exec "$prefix-n${host#node}" sh -c "$*"
