#!/bin/sh
# deploy/slurm/railwave-run.sh on a real Slurm (Debian's slurm-wlm 22.05 and munge): the test
# starts its own munged, slurmctld and slurmd (one Slurm node, every file in a temporary folder,
# its own ports), then runs the launcher in an allocation as an operator would:
#   1. a 3-node loopback cluster (3 daemons on the one Slurm node, --identity index) and a
#      6-rank trainer step of tests/integration/rw_rank.c that verifies every dispatched row and
#      combined sum; each rank checks what the launcher forwarded (RAILWAVE_SOCKET,
#      RAILWAVE_NODE, RAILWAVE_GROUP); the daemons are gated by `railwave wait`, then drained by
#      SIGTERM (each logs the drain and exits 0), and their sockets and run folder are gone;
#   2. a cluster file with more nodes than the job's daemons: refused before anything starts;
#   3. SIGTERM to the launcher while the trainer runs: its trap stops the trainer, drains the
#      daemons, removes the run folder and exits 143;
#   4. `railwave calibrate --launcher 'srun ...'` (docs/tools.md "Calibrating on a cluster of
#      hosts") against the 3 daemons of run 1's kind, whose cluster file names an anchors file:
#      every worker runs as a task of its own srun step and is pointed at its own daemon's sockets
#      only (the task-to-daemon map of --identity index); the table is written and parses, every
#      daemon reloads it (its log, its stats), and `--check` through the same launcher reports
#      regret. The launcher's --group-area-mib / --group-pool-mib reach every daemon (their
#      stats: a pool of 2 carve-outs).
#   5. two jobs on the one node with one cluster file, each with --port-offset job, run at once;
#      a third on the first one's ports fails, saying the port is in use and what to do; each
#      trainer rank sees torch.distributed's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
#      MASTER_ADDR, MASTER_PORT; railwaved is found next to railwave when RAILWAVED is unset.
# Afterwards no railwaved, slurm or munge process of the test is left and nothing on disk.
# Needs root (slurmd, munged); exits 77 (skip) otherwise or without the packages. Debugging:
# RW_TEST_KEEP=1 keeps the folder (logs, slurm.conf); RW_TEST_ONLY1=1 stops after scenario 1.
set -u
b=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "$b/.." && pwd)
run="$src/deploy/slurm/railwave-run.sh"
[ "$(id -u)" = 0 ] || { echo "SKIP: needs root (slurmd and munged)"; exit 77; }
for c in slurmctld slurmd munged salloc scontrol squeue scancel; do
	command -v $c >/dev/null 2>&1 || { echo "SKIP: no $c (scripts/setup installs slurm-wlm and munge)"; exit 77; }
done
[ -x "$b/railwaved" ] && [ -x "$b/tools/railwave" ] && [ -x "$b/tests/integration/rw_rank" ] ||
	{ echo "SKIP: build railwaved, railwave and rw_rank first"; exit 77; }

T=$(mktemp -d /tmp/rwslurm.XXXXXX)
chmod 755 "$T"
fail=0
no() { echo "FAIL: $*"; fail=1; }
stop_pidfile() { # kill the daemon whose pid file we own, and wait until it is gone
	[ -f "$1" ] || return 0
	pid=$(cat "$1"); kill "$pid" 2>/dev/null
	i=0; while kill -0 "$pid" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
	kill -9 "$pid" 2>/dev/null
}
cleanup() {
	stop_pidfile "$T/slurmd.pid"; stop_pidfile "$T/slurmctld.pid"; stop_pidfile "$T/munged.pid"
	[ -n "${RW_TEST_KEEP:-}" ] && echo "kept $T" || rm -rf "$T"
}
trap cleanup EXIT

# Ports below the kernel's ephemeral range: srun listens on ephemeral ports of the wildcard
# address while the daemons start, and one of those once took a daemon's port (the daemon could
# not bind; its peers' hellos reached srun: "failed reading io init message").
ports=$(python3 -c 'import random, socket
lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
picked = []
while len(picked) < 14:
    p = random.randrange(max(1024, lo - 12000), lo)
    s = socket.socket()
    try:
        s.bind(("0.0.0.0", p))
    except OSError:
        continue
    finally:
        s.close()
    if p not in picked:
        picked.append(p)
print(" ".join(map(str, picked)))')
set -- $ports
ctl_port=$1 d_port=$2; shift 2
node_ports=$*   # 3 per cluster node (control, 2 rails), up to 4 nodes

# ---- munge and Slurm, all in $T ---------------------------------------------------------------
dd if=/dev/urandom of="$T/munge.key" bs=1024 count=1 2>/dev/null; chmod 400 "$T/munge.key"
munged --socket="$T/munge.sock" --key-file="$T/munge.key" --pid-file="$T/munged.pid" \
	--log-file="$T/munged.log" --seed-file="$T/munged.seed" --force ||
	{ echo "FAIL: munged did not start"; cat "$T/munged.log"; exit 1; }
mkdir -p "$T/state" "$T/spool"
host=$(hostname -s)
cat > "$T/slurm.conf" <<EOC
ClusterName=rwtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctl_port
SlurmdPort=$d_port
AuthType=auth/munge
AuthInfo=socket=$T/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/slurmctld.log
SlurmdLogFile=$T/slurmd.log
PlugStackConfig=$T/plugstack.conf
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
KillWait=30
SlurmdParameters=config_overrides
NodeName=rwnode NodeHostname=$host NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=rw Nodes=rwnode Default=YES MaxTime=INFINITE State=UP
EOC
: > "$T/plugstack.conf"
export SLURM_CONF="$T/slurm.conf"
slurmctld -i || { echo "FAIL: slurmctld"; tail "$T/slurmctld.log"; exit 1; }
slurmd -N rwnode || { echo "FAIL: slurmd"; tail "$T/slurmd.log"; exit 1; }
i=0
until sinfo -h -o %t 2>/dev/null | grep -qx idle; do
	i=$((i + 1)); [ $i -gt 300 ] && { echo "FAIL: the Slurm node never became idle"; tail "$T"/*.log; exit 1; }
	sleep 0.1
done

# ---- a 3-node loopback cluster for 3 daemons on the one Slurm node -----------------------------
cluster() { # cluster FILE NODES
	python3 - "$1" "$2" $node_ports <<'EOP'
import json, sys
path, n, ports = sys.argv[1], int(sys.argv[2]), [int(p) for p in sys.argv[3:]]
nodes = [{"name": "n%d" % i, "control": "127.0.0.%d:%d" % (i + 1, ports[3 * i]),
          "rails": ["127.0.%d.%d:%d" % (r, i + 1, ports[3 * i + 1 + r]) for r in range(2)]}
         for i in range(n)]
json.dump({"cluster": "slurmtest", "transport": "tcp", "gpus_per_node": 2, "http": "0",
           "phase_timeout_ms": 5000, "heartbeat_interval_ms": 100, "heartbeat_timeout_ms": 2000,
           "recv_region_mib": 4, "nodes": nodes}, open(path, "w"))
EOP
}
cluster "$T/cluster.json" 3
cat > "$T/trainer.sh" <<EOT
#!/bin/sh
# One trainer rank: check what the launcher forwarded, then the verified phases.
want_node=\$((SLURM_PROCID / 2))
[ "\$RAILWAVE_NODE" = "\$want_node" ] || { echo "rank \$SLURM_PROCID: RAILWAVE_NODE '\$RAILWAVE_NODE', want \$want_node"; exit 3; }
[ "\$RAILWAVE_SOCKET" = "\$RAILWAVE_RUNDIR/\$want_node.sock" ] && [ "\${RAILWAVE_RUNDIR#$T/run}" != "\$RAILWAVE_RUNDIR" ] || { echo "rank \$SLURM_PROCID: RAILWAVE_SOCKET '\$RAILWAVE_SOCKET'"; exit 3; }
[ "\$RAILWAVE_GROUP" = "job-\$SLURM_JOB_ID" ] || { echo "rank \$SLURM_PROCID: RAILWAVE_GROUP '\$RAILWAVE_GROUP'"; exit 3; }
[ -S "\$RAILWAVE_SOCKET" ] || { echo "rank \$SLURM_PROCID: no socket"; exit 3; }
echo "\$RAILWAVE_GROUP_KEY" | grep -Eqx '[0-9a-f]{64}' || { echo "rank \$SLURM_PROCID: RAILWAVE_GROUP_KEY '\$RAILWAVE_GROUP_KEY'"; exit 3; }
# torch.distributed's variables
[ "\$RANK" = "\$SLURM_PROCID" ] && [ "\$WORLD_SIZE" = "\$((RW_T_NODES * 2))" ] && [ "\$LOCAL_RANK" = "\$SLURM_LOCALID" ] &&
	[ "\$LOCAL_WORLD_SIZE" = "\$((RW_T_NODES * 2))" ] && [ -n "\$MASTER_ADDR" ] &&
	[ "\$MASTER_PORT" = "\$((29500 + SLURM_JOB_ID % 1000))" ] ||
	{ echo "rank \$SLURM_PROCID: RANK '\$RANK' WORLD_SIZE '\$WORLD_SIZE' LOCAL_RANK '\$LOCAL_RANK' LOCAL_WORLD_SIZE '\$LOCAL_WORLD_SIZE' MASTER_ADDR '\$MASTER_ADDR' MASTER_PORT '\$MASTER_PORT'"; exit 3; }
exec "$b/tests/integration/rw_rank" "\$RAILWAVE_SOCKET" "\$RAILWAVE_GROUP" "\$SLURM_PROCID" \$RW_T_NODES 2 12 3 4 11 \${RW_TEST_MODE:-ok}
EOT
chmod +x "$T/trainer.sh"
export RAILWAVED="$b/railwaved" RAILWAVE="$b/tools/railwave" RW_T_NODES=3
launch() { # launch OUT ARGS...: the launcher in a 1-node, 6-task allocation
	out=$1; shift
	timeout 300 salloc -N1 --ntasks-per-node=6 --job-name=rwtest \
		sh "$run" --config "$T/cluster.json" --identity index --daemons-per-node 3 \
		--rundir "$T/run" --ready-timeout 30 --daemon-output "$T/railwaved-%j-%t.log" "$@" >"$out" 2>&1
}
left_behind() { pgrep -f "railwaved --config $T/" >/dev/null || pgrep -f "$T/trainer.sh" >/dev/null; }

# 1. the whole run
launch "$T/run1.out" -- "$T/trainer.sh"; rc=$?
[ $rc = 0 ] || no "launcher exit $rc"
n=$(grep -c '^rank [0-5]: 4 steps x 3 layers verified' "$T/run1.out")
[ "$n" = 6 ] || no "$n of 6 ranks verified their phases"
grep -q 'railwave-run: 3 daemons ready (every peer up); starting the trainer' "$T/run1.out" || no "no readiness gate"
grep -q 'railwave-run: daemons drained and stopped' "$T/run1.out" || no "daemons did not stop cleanly"
for t in 0 1 2; do
	f=$(ls "$T"/railwaved-*-$t.log 2>/dev/null | head -n 1)
	[ -n "$f" ] || { no "no log of daemon $t"; continue; }
	grep -q "node=n$t INFO shutdown: signal 15, draining in-flight phases" "$f" || no "daemon $t got no SIGTERM"
	grep -q "node=n$t INFO stopping" "$f" || no "daemon $t did not stop"
	grep -q " ERROR " "$f" && no "daemon $t logged an error: $(grep ' ERROR ' "$f" | head -n 3)"
done
[ ! -e "$T/run" ] || no "the run folder is left: $(ls -la "$T/run")"
left_behind && no "processes left after run 1"
[ $fail = 0 ] || { echo "---- launcher ----"; tail -n 40 "$T/run1.out"; tail -n 15 "$T"/railwaved-*.log; }

[ -n "${RW_TEST_ONLY1:-}" ] && exit $fail
# 2. a cluster file with a node no daemon of this job will be: refused up front
cluster "$T/cluster.json" 4
launch "$T/run2.out" -- "$T/trainer.sh"; rc=$?
[ $rc = 1 ] && grep -q "lists more than this job's 3 daemons" "$T/run2.out" || no "4-node file for 3 daemons: rc $rc: $(cat "$T/run2.out")"
grep -q 'starting the trainer' "$T/run2.out" && no "a refused launch started the trainer"
cluster "$T/cluster.json" 3

# 3. SIGTERM to the launcher (job cancelled) while the trainer runs
rm -f "$T"/railwaved-*.log
RW_TEST_MODE=idle launch "$T/run3.out" -- "$T/trainer.sh" &
salloc_pid=$!
i=0
until grep -q 'starting the trainer' "$T/run3.out" 2>/dev/null && [ "$(grep -c '^ready' "$T/run3.out")" = 6 ]; do
	i=$((i + 1)); [ $i -gt 600 ] && break; sleep 0.1
done
grep -c '^ready' "$T/run3.out" | grep -qx 6 || no "run 3: ranks not connected: $(cat "$T/run3.out")"
lpid=$(pgrep -f "^sh $run --config $T/cluster.json")   # the launcher, not salloc
[ -n "$lpid" ] && kill -TERM "$lpid"
wait $salloc_pid; rc=$?
grep -q 'railwave-run: signal, stopping' "$T/run3.out" || no "run 3: the launcher's trap did not run"
grep -q 'railwave-run: daemons drained and stopped' "$T/run3.out" || no "run 3: daemons not drained: $(tail -n 5 "$T/run3.out")"
[ $rc = 143 ] || no "run 3: launcher exit $rc, want 143"
[ ! -e "$T/run" ] || no "run 3: the run folder is left"
left_behind && no "processes left after run 3"

# 4. railwave calibrate through srun: one worker task per daemon, each on its own sockets
python3 - "$T/cluster.json" "$T/anchors.json" <<'EOP'
import json, sys
c = json.load(open(sys.argv[1]))
c["anchors"] = sys.argv[2]
json.dump(c, open(sys.argv[1], "w"))
json.dump({"schema_version": 1, "fingerprint": {"nodes": 3, "gpus_per_node": 2, "rails": 2,
           "nic_gbps": 100.0, "transport": "tcp"}, "max_size_ratio": 4, "shape_tolerance": 0.15,
           "anchors": []}, open(sys.argv[2], "w"))
EOP
cat > "$T/calibrate.sh" <<'EOT'
#!/bin/sh
# Task 0 of the trainer step is the operator: calibrate, check, then every daemon's stats.
[ "$SLURM_PROCID" = 0 ] || exit 0
wl="--experts 12 --topk 2 --hidden 256 --tokens 32"
# The workers' step: task i is daemon i's worker (--identity index), told its node and sockets.
L='srun --overlap -n3 --ntasks-per-node=3 --kill-on-bad-exit=1 --job-name=rwcal sh -c "RAILWAVE_NODE=$SLURM_PROCID RAILWAVE_SOCKET=$RAILWAVE_RUNDIR/$SLURM_PROCID.sock RAILWAVE_STATS_SOCKET=$RAILWAVE_RUNDIR/$SLURM_PROCID.stats exec \"$@\"" worker'
unset RAILWAVE_SOCKET RAILWAVE_STATS_SOCKET RAILWAVE_NODE
"$RAILWAVE" calibrate --config "$RW_T/cluster.json" --launcher "$L" --short --reps 2 $wl; echo "calibrate rc $?"
"$RAILWAVE" calibrate --config "$RW_T/cluster.json" --launcher "$L" --check "$RW_T/anchors.json" --short --reps 2 $wl
echo "check rc $?"
"$RAILWAVE" bench-workload describe --anchors "$RW_T/anchors.json" --nic-gbps 100 --nodes 3 --gpus 2 --rails 2 $wl |
	python3 -c 'import json, sys; print("table_error [%s]" % json.load(sys.stdin)["selection"]["table_error"])'
for i in 0 1 2; do
	"$RAILWAVE" stats --socket "$RAILWAVE_RUNDIR/$i.stats" | sed -n "s/^\(node\|anchors\|anchor_reloads\|carve_outs\) /stats $i \1 /p"
done
EOT
chmod +x "$T/calibrate.sh"
rm -f "$T"/railwaved-*.log
RW_T=$T launch "$T/run4.out" --group-area-mib 256 --group-pool-mib 512 -- "$T/calibrate.sh"; rc=$?
[ $rc = 0 ] || no "run 4: launcher exit $rc"
grep -q '^calibrate rc 0$' "$T/run4.out" || no "run 4: calibrate failed"
grep -q "^wrote $T/anchors.json: 2 anchors" "$T/run4.out" || no "run 4: no table written"
grep -q '^table_error \[\]$' "$T/run4.out" || no "run 4: the table does not parse or match the cluster"
grep -q '^check rc [01]$' "$T/run4.out" && grep -q 'regret against the fastest path: worst' "$T/run4.out" ||
	no "run 4: --check through srun reported no regret"
for t in 0 1 2; do
	grep -q "^node n$t: worker on .*, peers up" "$T/run4.out" || no "run 4: no worker for n$t"
	grep -q "^reloaded (SIGHUP): .*n$t (pid [0-9]*, on " "$T/run4.out" || no "run 4: n$t not reloaded"
	grep -q "^stats $t node n$t$" "$T/run4.out" && grep -q "^stats $t anchors 2$" "$T/run4.out" &&
		grep -q "^stats $t anchor_reloads 1$" "$T/run4.out" &&
		grep -q "^stats $t carve_outs [0-2]/2$" "$T/run4.out" || no "run 4: n$t's stats: $(grep "^stats $t" "$T/run4.out")"
	f=$(ls "$T"/railwaved-*-$t.log 2>/dev/null | head -n 1)
	grep -q "anchors: loaded 2 anchors from $T/anchors.json" "$f" 2>/dev/null || no "run 4: n$t did not log the reload"
done
pids=$(sed -n 's/^node n[0-2]: worker on .*, railwaved pid \([0-9]*\), peers up$/\1/p' "$T/run4.out" | sort -u | wc -l)
[ "$pids" = 3 ] || no "run 4: the workers reached $pids distinct daemons, want 3"
[ $fail = 0 ] || { echo "---- run 4 ----"; tail -n 40 "$T/run4.out"; }
left_behind && no "processes left after run 4"

# 5. two jobs on the one node with the same cluster file: each shifts its ports (--port-offset
#    job) and both run at once; a third with the first one's ports is refused with a message
#    that says why. Job B finds railwaved next to railwave (RAILWAVED unset).
cluster "$T/c2.json" 2
launch2() { # launch2 OUT ARGS...: a 1-node, 4-task allocation running 2 daemons
	out=$1; shift
	TMPDIR=$T timeout 120 salloc -N1 --ntasks-per-node=4 --job-name=rwtest2 \
		sh "$run" --config "$T/c2.json" --identity index --daemons-per-node 2 \
		--rundir "$T/run-$(basename "$out" .out)" --ready-timeout 30 "$@" -- "$T/trainer.sh" >"$out" 2>&1
}
RW_T_NODES=2 RW_TEST_MODE=idle launch2 "$T/run5a.out" --port-offset job &
a_pid=$!
i=0
until [ "$(grep -c '^ready' "$T/run5a.out" 2>/dev/null)" = 4 ]; do
	i=$((i + 1)); [ $i -gt 600 ] && break; sleep 0.1
done
grep -c '^ready' "$T/run5a.out" | grep -qx 4 || no "run 5: job A's ranks not connected: $(tail -n 5 "$T/run5a.out")"
off_a=$(sed -n 's/^railwave-run: ports of .* shifted by \([0-9]*\) for this job.*/\1/p' "$T/run5a.out")
[ -n "$off_a" ] || no "run 5: job A did not shift its ports: $(head -n 5 "$T/run5a.out")"
(unset RAILWAVED; RW_T_NODES=2 launch2 "$T/run5b.out" --port-offset job); rc=$?
[ $rc = 0 ] && [ "$(grep -c '^rank [0-3]: 4 steps x 3 layers verified' "$T/run5b.out")" = 4 ] ||
	no "run 5: job B beside job A: rc $rc: $(tail -n 8 "$T/run5b.out")"
RW_T_NODES=2 launch2 "$T/run5c.out" --port-offset "${off_a:-0}"; rc=$?
[ $rc = 1 ] && grep -q "status 2: a configuration error.*--port-offset" "$T/run5c.out" ||
	no "run 5: job C on job A's ports: rc $rc: $(tail -n 5 "$T/run5c.out")"
grep -q "port is in use" "$T/run5c.out" || no "run 5: job C's daemons did not say the port is in use"
lpid=$(pgrep -f "^sh $run --config $T/c2.json" | head -n 1)
[ -n "$lpid" ] && kill -TERM "$lpid"
wait $a_pid; rc=$?
[ $rc = 143 ] && grep -q 'railwave-run: daemons drained and stopped' "$T/run5a.out" ||
	no "run 5: job A did not stop cleanly: rc $rc: $(tail -n 5 "$T/run5a.out")"
grep -q 'scancel: error' "$T"/run*.out && no "a scancel error line: $(grep 'scancel: error' "$T"/run*.out)"
left=$(ls "$T"/railwave-*.json "$T"/railwave-*.key 2>/dev/null)
[ -z "$left" ] || no "run 5: the jobs' shifted cluster files or keys are left: $left"
left_behind && no "processes left after run 5"

[ $fail = 0 ] && echo "slurm launcher: ok"
exit $fail
