#!/bin/sh
# Run a training command under Slurm with railwaved daemons started for the job
# (docs/service.md "Running it: Slurm").
#   sbatch -N 4 --ntasks-per-node=8 --gpus-per-node=8 --signal=B:TERM@120 \
#       deploy/slurm/railwave-run.sh --config /shared/railwave/cluster.json [OPTIONS] -- python train.py
# --ntasks-per-node is the number of trainer ranks per node (one per GPU, = gpus_per_node of the
# cluster file); the daemons run as a step of their own, --daemons-per-node tasks per node, on
# CPUs they share with the ranks (--overlap), bound to none of them (--cpu-bind=none: under
# task/affinity a bound daemon would share one CPU with a rank). --signal=B:TERM@S gives this
# script S seconds before the time limit to stop the trainer and drain the daemons. The cluster
# file's ports are the same for every job: two jobs that share a node need --exclusive, or
# --port-offset job (or distinct N) so that their daemons listen on different ports.
# Options:
#   --config FILE          cluster file listing exactly the nodes of this job (required)
#   --identity name|index  name (default): the daemon on Slurm node X is the cluster's node X;
#                          index: daemon task i of the step (block order) is the cluster's node i
#   --daemons-per-node K   daemons on each allocated node (default 1; K > 1 needs --identity index:
#                          loopback clusters, tests)
#   --ready-timeout S      seconds to wait for every daemon to have every peer up (default 120)
#   --rundir DIR           socket folder on every node (default ${TMPDIR:-/tmp}/railwave-JOBID)
#   --daemon-output PAT    srun --output pattern for the daemons' logs (default: the job's output)
#   --key FILE             the cluster key (railwave keygen, mode 0600) at FILE on every node,
#                          e.g. on shared storage; default: the cluster file's key_file, else a
#                          key made for this job, copied to every node with sbcast and removed
#                          at the end (docs/install.md "The cluster key")
#   --port-offset N|job    add N to every port of the cluster file (job: 10 x (JOBID mod 100)); the
#                          shifted file is copied to every node with sbcast
#   --daemon-cpu-bind B    srun --cpu-bind for the daemons' step (default none)
#   --anchors FILE, --path P, --transport T, --log-level L, --phase-timeout-ms MS: for railwaved
#   --group-area-mib MIB, --group-local-mib MIB, --group-pool-mib MIB: the rank path's carve-outs
#                          for this job's shape
#                          (`railwave size`, docs/service.md "Turning on the rank path")
# The ranks get RAILWAVE_SOCKET (their node's daemon), RAILWAVE_NODE (its index in the cluster
# file), RAILWAVE_GROUP (job-JOBID: a group name no other job shares), RAILWAVE_GROUP_KEY (32
# random bytes in hex, new for each job unless already set: the group key every rank presents,
# docs/ipc.md "Rank authentication") and RAILWAVE_RUNDIR; and torch.distributed's RANK,
# WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (from the step) and MASTER_ADDR (the job's first node),
# MASTER_PORT (29500 + JOBID mod 1000) unless already set. The trainer step is killed whole when
# one rank fails (--kill-on-bad-exit). At the end, or on SIGTERM/SIGINT, the daemons get SIGTERM
# through `scancel --signal=TERM` of their step, drain, exit, and remove their sockets and the
# run folder.
# Exit status: the trainer step's; 1 when the daemons did not start, get ready, or stop cleanly;
# 2 bad usage. RAILWAVED and RAILWAVE name the binaries (default: from PATH; railwaved, which
# installs into sbin, also next to railwave: ../sbin/railwaved, or ../railwaved in a build tree).
set -u

me=railwave-run
usage() { sed -n '2,44p' "$0" >&2; exit 2; }
die() { echo "$me: $*" >&2; exit 1; }
bad() { echo "$me: $*" >&2; exit 2; }

config= identity=name per=1 ready_timeout=120 rundir= daemon_output= key= port_offset=0
cpu_bind=none
while [ $# -gt 0 ]; do
	case "$1" in
	--config|--identity|--daemons-per-node|--ready-timeout|--rundir|--daemon-output|--anchors|\
	--path|--transport|--log-level|--phase-timeout-ms|--key|--port-offset|--daemon-cpu-bind|\
	--group-area-mib|--group-local-mib|--group-pool-mib)
		[ $# -ge 2 ] || bad "$1 needs a value"
		case "$1" in
		--config) config=$2 ;;
		--identity) identity=$2 ;;
		--daemons-per-node) per=$2 ;;
		--ready-timeout) ready_timeout=$2 ;;
		--rundir) rundir=$2 ;;
		--daemon-output) daemon_output=$2 ;;
		--key) key=$2 ;;
		--port-offset) port_offset=$2 ;;
		--daemon-cpu-bind) cpu_bind=$2 ;;
		--anchors) export RAILWAVE_ANCHORS="$2" ;;
		--path) export RAILWAVE_PATH="$2" ;;
		--transport) export RAILWAVE_TRANSPORT="$2" ;;
		--log-level) export RAILWAVE_LOG_LEVEL="$2" ;;
		--phase-timeout-ms) export RAILWAVE_PHASE_TIMEOUT_MS="$2" ;;
		--group-area-mib) export RAILWAVE_GROUP_AREA_MIB="$2" ;;
		--group-local-mib) export RAILWAVE_GROUP_LOCAL_MIB="$2" ;;
		--group-pool-mib) export RAILWAVE_GROUP_POOL_MIB="$2" ;;
		esac
		shift 2 ;;
	-h|--help) sed -n '2,44p' "$0"; exit 0 ;;
	--) shift; break ;;
	*) bad "unknown option '$1' (see --help)" ;;
	esac
done
[ -n "$config" ] || bad "--config FILE is required"
[ $# -gt 0 ] || bad "no training command after --"
case "$identity" in name|index) ;; *) bad "--identity: expected name or index, not '$identity'" ;; esac
case "$per" in ''|*[!0-9]*|0) bad "--daemons-per-node: expected a positive integer, not '$per'" ;; esac
[ "$per" = 1 ] || [ "$identity" = index ] || bad "--daemons-per-node $per needs --identity index"
case "$ready_timeout" in ''|*[!0-9.]*) bad "--ready-timeout: expected seconds, not '$ready_timeout'" ;; esac
[ -n "${SLURM_JOB_ID:-}" ] || bad "run inside a Slurm allocation (sbatch or salloc)"
case "$port_offset" in
job) port_offset=$(( SLURM_JOB_ID % 100 * 10 )) ;;
''|*[!0-9]*) bad "--port-offset: expected a number of ports or 'job', not '$port_offset'" ;;
esac
RAILWAVE=${RAILWAVE:-railwave}
command -v "$RAILWAVE" >/dev/null || die "no railwave ($RAILWAVE); set RAILWAVE or PATH"
RAILWAVE=$(command -v "$RAILWAVE")
if [ -z "${RAILWAVED:-}" ]; then
	# scripts/install puts railwaved in sbin, which is not on a user's PATH (the daemons run as
	# the job's user here): also look next to railwave.
	bindir=$(dirname "$RAILWAVE")
	for RAILWAVED in "$(command -v railwaved)" "$bindir/../sbin/railwaved" "$bindir/../railwaved" \
			 /usr/sbin/railwaved /usr/local/sbin/railwaved ""; do
		[ -n "$RAILWAVED" ] && [ -x "$RAILWAVED" ] && break
	done
	[ -n "$RAILWAVED" ] || die "no railwaved on PATH, in $bindir/../sbin or /usr/(local/)sbin; set RAILWAVED"
fi
command -v "$RAILWAVED" >/dev/null || die "no railwaved ($RAILWAVED); set RAILWAVED or PATH"
nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
ndaemons=$((nnodes * per))
rundir=${rundir:-${TMPDIR:-/tmp}/railwave-$SLURM_JOB_ID}
unset RAILWAVE_IPC_SOCKET RAILWAVE_SOCKET RAILWAVE_STATS_SOCKET RAILWAVE_NODE

# ---- the job's ports: the cluster file as it is, or every port shifted (--port-offset) ----------
# The shifted copy is written here and broadcast to the same path on every node (sbcast), where
# the last daemon task of each node removes it at the end.
job_config=
if [ "$port_offset" != 0 ]; then
	command -v python3 >/dev/null || die "--port-offset needs python3 on the batch node"
	job_config=${TMPDIR:-/tmp}/railwave-$SLURM_JOB_ID.json
	src=$(mktemp "${TMPDIR:-/tmp}/railwave-config.XXXXXX") || die "cannot make a temporary file"
	python3 - "$config" "$port_offset" "$src" <<'EOP' || { rm -f "$src"; die "--port-offset: cannot rewrite $config"; }
import json, sys
path, off, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
c = json.load(open(path))
def shift(text):  # "ADDR:PORT" -> "ADDR:PORT+off"; "ADDR" keeps the (shifted) default port
    addr, colon, port = text.partition(":")
    return "%s:%d" % (addr, int(port) + off) if colon and int(port) else text
for k, d in (("control_port", 7400), ("rail_port", 7500)):
    c[k] = c.get(k, d) + off
if isinstance(c.get("http", "127.0.0.1:9470"), str):
    c["http"] = shift(c.get("http", "127.0.0.1:9470"))
for n in c["nodes"]:
    for k in ("control", "http"):
        if isinstance(n.get(k), str):
            n[k] = shift(n[k])
    for i, r in enumerate(n["rails"]):
        if isinstance(r, str):
            n["rails"][i] = shift(r)
        elif "port" in r:
            r["port"] += off
        elif isinstance(r.get("address"), str):
            r["address"] = shift(r["address"])
json.dump(c, open(out, "w"), indent=1)
EOP
	sbcast -f "$src" "$job_config" || { rm -f "$src"; die "cannot copy the job's cluster file to its nodes (sbcast)"; }
	rm -f "$src"
	echo "$me: ports of $config shifted by $port_offset for this job ($job_config)" >&2
	config=$job_config
fi
export RW_RUN_JOBCONFIG="$job_config"

# The cluster file must name every daemon of this job and nothing else (/ready waits for every
# configured peer): check on this node before starting anything.
if [ "$identity" = name ]; then
	ids=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}") || die "cannot list the job's nodes"
else
	ids=$(seq 0 $((ndaemons - 1)))
fi
for id in $ids; do
	out=$("$RAILWAVED" --config "$config" --node "$id" --dump-config 2>&1 >/dev/null) ||
		die "the cluster file cannot run node $id: ${out#railwaved: }"
done
"$RAILWAVED" --config "$config" --node "$ndaemons" --dump-config >/dev/null 2>&1 &&
	die "$config lists more than this job's $ndaemons daemons; /ready would wait for the others"
drain_ms=$("$RAILWAVED" --config "$config" --node "$(echo "$ids" | head -n 1)" --dump-config |
	sed -n 's/.*"phase_timeout_ms": *\([0-9]*\).*/\1/p')
stop_bound=$(( ${drain_ms:-10000} / 1000 + 6 ))   # drain bound (phase timeout + 1 s) + teardown

# ---- the cluster key: --key, the cluster file's key_file, or one made for this job ---------------
# A job key is made here (mode 0600) and broadcast to the same path on every node (sbcast -p
# keeps the mode); the last daemon task of each node removes its copy when its daemon has stopped.
job_key=
if [ -n "$key" ]; then
	export RAILWAVE_KEY_FILE="$key"
elif ! "$RAILWAVED" --config "$config" --node "$(echo "$ids" | head -n 1)" --dump-config |
	grep -q '"key_file": *"[^"]'; then
	job_key=${TMPDIR:-/tmp}/railwave-$SLURM_JOB_ID.key
	src=$(mktemp "${TMPDIR:-/tmp}/railwave-key.XXXXXX") || die "cannot make a temporary file"
	"$RAILWAVE" keygen --force "$src" 2>/dev/null || { rm -f "$src"; die "railwave keygen failed"; }
	sbcast -p -f "$src" "$job_key" || { rm -f "$src"; die "cannot copy the job's key to its nodes (sbcast)"; }
	rm -f "$src"
	export RAILWAVE_KEY_FILE="$job_key"
fi
export RW_RUN_JOBKEY="$job_key"

export RW_RUN_CONFIG="$config" RW_RUN_IDENTITY="$identity" RW_RUN_DIR="$rundir"
export RW_RUN_DAEMONS="$ndaemons" RW_RUN_TIMEOUT="$ready_timeout" RAILWAVED RAILWAVE
export RAILWAVE_RUNDIR="$rundir" RAILWAVE_GROUP="job-$SLURM_JOB_ID"
# The job's group key, given to the trainer step only (the environment, never a command line).
group_key=${RAILWAVE_GROUP_KEY:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}
[ ${#group_key} -ge 16 ] || die "cannot make a group key (/dev/urandom)"
unset RAILWAVE_GROUP_KEY
# The daemon (or rank) id of a task: its Slurm node name, or its daemon index in block order.
id_of_task='if [ "$RW_RUN_IDENTITY" = index ]; then
	id=$(( SLURM_PROCID / (SLURM_STEP_NUM_TASKS / RW_RUN_DAEMONS) ))
else id=$SLURMD_NODENAME; fi'

# ---- the daemons: one step, $per tasks per node -------------------------------------------------
# Not bound to a CPU (or as --daemon-cpu-bind says) where the cluster binds tasks at all: under
# task/none srun would only print that it cannot.
cpu_bind_opt=--cpu-bind=$cpu_bind
scontrol show config 2>/dev/null | grep -Eq '^TaskPlugin *= *task/none$' && cpu_bind_opt=
# Each task's shell stays (it does not exec) to remove the sockets and the folder after the
# daemon; it ignores the step's SIGTERM (trap, reset for the daemon by exec) so that only the
# daemon drains and the step ends when the daemon does.
# shellcheck disable=SC2016
srun --overlap --nodes="$nnodes" --ntasks="$ndaemons" --ntasks-per-node="$per" --distribution=block \
	--kill-on-bad-exit=0 ${cpu_bind_opt:+"$cpu_bind_opt"} --job-name=railwaved ${daemon_output:+--output="$daemon_output"} \
	sh -c "$id_of_task"'
	trap : TERM INT
	mkdir -p -m 0700 "$RW_RUN_DIR" || exit 1
	RAILWAVE_SOCKET=$RW_RUN_DIR/$id.sock RAILWAVE_STATS_SOCKET=$RW_RUN_DIR/$id.stats \
		"$RAILWAVED" --config "$RW_RUN_CONFIG" --node "$id"
	rc=$?
	rm -f "$RW_RUN_DIR/$id.sock" "$RW_RUN_DIR/$id.stats"
	# The last daemon of the node empties the run folder: it removes the files they share.
	if rmdir "$RW_RUN_DIR" 2>/dev/null; then
		[ -z "$RW_RUN_JOBKEY" ] || rm -f "$RW_RUN_JOBKEY"
		[ -z "$RW_RUN_JOBCONFIG" ] || rm -f "$RW_RUN_JOBCONFIG"
	fi
	exit $rc' &
daemons=$!
trainer= trainer_rc=1

# Stop the daemons with a signal that lets them drain: SIGTERM to their step's tasks.
stop_daemons() {
	[ -n "$daemons" ] || return 0
	step=$(squeue --steps --jobs "$SLURM_JOB_ID" --noheader --format '%i %j' 2>/dev/null |
		awk '$2 == "railwaved" { print $1; exit }')
	# (a step already ending, e.g. the whole job cancelled, is no error: scancel's is dropped)
	if [ -n "$step" ]; then scancel --signal=TERM "$step" 2>/dev/null; else kill -TERM "$daemons" 2>/dev/null; fi
	i=0
	while kill -0 "$daemons" 2>/dev/null && [ $i -lt $((stop_bound * 10)) ]; do
		sleep 0.1; i=$((i + 1))
	done
	if kill -0 "$daemons" 2>/dev/null; then
		echo "$me: daemons still draining after ${stop_bound}s; cancelling their step" >&2
		[ -n "$step" ] && scancel "$step" 2>/dev/null
	fi
	wait "$daemons"; drc=$?
	daemons=
	if [ $drc = 0 ]; then echo "$me: daemons drained and stopped" >&2
	else echo "$me: daemon step ended with status $drc" >&2; fi
	return $drc
}
finish() {
	trap - EXIT INT TERM
	if [ -n "$trainer" ] && kill -0 "$trainer" 2>/dev/null; then
		kill -TERM "$trainer" 2>/dev/null # srun forwards it to the ranks
		wait "$trainer"
	fi
	stop_daemons; drc=$?
	[ "$trainer_rc" = 0 ] && [ $drc != 0 ] && trainer_rc=1
	exit "$trainer_rc"
}
trap finish EXIT
trap 'echo "$me: signal, stopping" >&2; trainer_rc=143; finish' TERM
trap 'echo "$me: interrupted, stopping" >&2; trainer_rc=130; finish' INT

# ---- gate: every daemon has every peer up (railwave wait), or the daemons died -------------------
# shellcheck disable=SC2016
srun --overlap --nodes="$nnodes" --ntasks="$ndaemons" --ntasks-per-node="$per" --distribution=block \
	--kill-on-bad-exit=1 --job-name=railwave-wait \
	sh -c "$id_of_task"'
	exec "$RAILWAVE" wait --quiet --socket "$RW_RUN_DIR/$id.stats" --timeout "$RW_RUN_TIMEOUT"' &
waiter=$!
while kill -0 "$waiter" 2>/dev/null; do
	if ! kill -0 "$daemons" 2>/dev/null; then
		kill -TERM "$waiter" 2>/dev/null; wait "$waiter"
		wait "$daemons"; drc=$?; daemons=
		[ $drc = 2 ] && die "the daemons exited (status 2: a configuration error, their log above says which; a port in use by another job's daemons on the same node needs --exclusive or --port-offset) before the cluster was ready"
		die "the daemons exited (status $drc) before the cluster was ready"
	fi
	sleep 0.2
done
wait "$waiter" || die "the daemons were not ready within ${ready_timeout}s (see above)"
echo "$me: $ndaemons daemons ready (every peer up); starting the trainer" >&2

# ---- the trainer: the allocation's tasks, each pointed at its node's daemon ------------------------
# torch.distributed's rendezvous: the job's first node, a port per job unless the caller set one.
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}" | head -n 1)}
MASTER_PORT=${MASTER_PORT:-$(( 29500 + SLURM_JOB_ID % 1000 ))}
export MASTER_ADDR MASTER_PORT
# shellcheck disable=SC2016
RAILWAVE_GROUP_KEY=$group_key srun --overlap --distribution=block --kill-on-bad-exit=1 \
	--job-name=trainer sh -c "$id_of_task"'
	export RAILWAVE_SOCKET="$RW_RUN_DIR/$id.sock"
	export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_STEP_NUM_TASKS LOCAL_RANK=$SLURM_LOCALID
	export LOCAL_WORLD_SIZE=$(( SLURM_STEP_NUM_TASKS / SLURM_STEP_NUM_NODES ))
	RAILWAVE_NODE=$("$RAILWAVE" stats --socket "$RW_RUN_DIR/$id.stats" | sed -n "s/^node_index //p")
	export RAILWAVE_NODE
	unset RW_RUN_CONFIG RW_RUN_IDENTITY RW_RUN_DIR RW_RUN_DAEMONS RW_RUN_TIMEOUT RW_RUN_JOBKEY \
		RW_RUN_JOBCONFIG
	unset RAILWAVE_KEY_FILE
	exec "$@"' sh "$@" &
trainer=$!
wait "$trainer"   # in the background so that a signal to this script runs its trap at once
trainer_rc=$?
trainer=
[ $trainer_rc = 0 ] || echo "$me: the trainer step failed (status $trainer_rc)" >&2
exit "$trainer_rc"
