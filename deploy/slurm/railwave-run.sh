#!/bin/sh
# Run a training command under Slurm with one railwaved per allocated node.
#   sbatch -N 4 --gpus-per-node=8 deploy/slurm/railwave-run.sh \
#       --config /shared/railwave/cluster.json [--anchors FILE] -- python train.py ...
# The cluster file must list every allocated node; each daemon finds itself by its Slurm node
# name (--node "$SLURMD_NODENAME"). The daemons run as one job step (one task per node), the
# trainer as another; when the trainer finishes the daemons get SIGTERM (they drain and exit).
# Sockets go to a per-job folder ($RAILWAVE_RUNDIR, default /tmp/railwave-$SLURM_JOB_ID) that
# the trainer finds through RAILWAVE_IPC_SOCKET.
set -eu

usage() { sed -n '2,10p' "$0" >&2; exit 2; }
config=
extra=
while [ $# -gt 0 ]; do
	case "$1" in
	--config) config=$2; shift 2 ;;
	--anchors|--path|--transport|--log-level) extra="$extra $1 $2"; shift 2 ;;
	--) shift; break ;;
	*) usage ;;
	esac
done
[ -n "$config" ] && [ $# -gt 0 ] || usage
: "${SLURM_JOB_ID:?run inside a Slurm allocation (sbatch or salloc)}"
: "${SLURM_JOB_NUM_NODES:?}"

RAILWAVED=${RAILWAVED:-railwaved}
rundir=${RAILWAVE_RUNDIR:-/tmp/railwave-$SLURM_JOB_ID}
export RAILWAVE_IPC_SOCKET="$rundir/railwaved.sock"
export RAILWAVE_STATS_SOCKET="$rundir/stats.sock"

# Fail early, on the first node, if the configuration does not parse.
"$RAILWAVED" --config "$config" --node "${SLURMD_NODENAME:-0}" --dump-config >/dev/null

# shellcheck disable=SC2086,SC2016
srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=0 \
	sh -c 'mkdir -p "$0" && exec "$1" --config "$2" --node "$SLURMD_NODENAME" $3' \
	"$rundir" "$RAILWAVED" "$config" "$extra" &
daemons=$!
trap 'kill -TERM $daemons 2>/dev/null; wait $daemons 2>/dev/null || true' EXIT INT TERM

# Wait until every node's daemon answers on its stats socket (at most 60 s).
# shellcheck disable=SC2016
srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 sh -c '
	i=0
	while [ ! -S "$0" ]; do
		i=$((i + 1)); [ $i -gt 600 ] && { echo "railwaved on $(hostname) did not start" >&2; exit 1; }
		sleep 0.1
	done' "$RAILWAVE_STATS_SOCKET"

srun "$@"
