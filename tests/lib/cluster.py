"""A cluster of real railwaved processes on loopback for the tests (tests/README.md): node n's
control address is 127.0.0.(n+1) and its rail r 127.0.r.(n+1), ports picked free, a cluster
key made for the run; rank processes are tests/integration/rw_rank (GPUS per node) that verify
every row and sum themselves. Also the small helpers the scripts share: free_port, the stats
socket client ask_stats, a process's CPU time and resident memory, waits on conditions
(wait_for, read_until, still_running), and the CUDA stand-in's hang switch (HangSwitch,
hang_cluster, held_cuda_job) for the hung-GPU scripts.

The build copies this file to $b/tests/lib/cluster.py, and a script run from $b/test/ imports
it from there:

    B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(B, "tests", "lib"))
    import cluster

so the module knows its build from where it lies (DAEMON, RANK, RAILWAVE, the CUDA stand-ins)
and nothing is patched from outside: what differs between clusters is an argument of Cluster."""
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAEMON = os.path.join(B, "railwaved")
RANK = os.path.join(B, "tests", "integration", "rw_rank")
PAGERANK = os.path.join(B, "tests", "integration", "rw_pagerank")
RAILWAVE = os.path.join(B, "tools", "railwave")
# A stand-in libcuda.so.1 whose IPC works across processes (tests/integration/fake_cuda_ipc.c),
# and the same with the CUDA mover's kernels run on the CPU (fake_cuda_kernels.c).
FAKE_CUDA = os.path.join(B, "tests", "integration", "libfakecuda_ipc.so")
FAKE_KERN = os.path.join(B, "tests", "integration", "libfakecuda_kern.so")
GPUS, RAILS = 2, 2  # ranks per node and rails per node unless a Cluster says otherwise


class RankPath:
    """cuda_ranks for ranks on the rank path (rw_rank --rank-path: librailwave's kernels on the
    rank's stream, docs/rankpath.md): `driver` is a stand-in libcuda (FAKE_KERN) or "real"; `ranks`
    the global ranks that take it (None: every rank), the others host-memory ranks. The daemons
    get group carve-outs (group_area_mib per rail from a pool of group_pool_mib), which the rank
    path needs; a cluster file's own keys (extra) override them."""

    def __init__(self, driver, ranks=None, area_mib=8, pool_mib=256):
        self.driver, self.ranks, self.area_mib, self.pool_mib = driver, ranks, area_mib, pool_mib

    def flags(self, r):
        return ["--rank-path"] if self.ranks is None or r in self.ranks else []
WAIT = 60.0  # bound on any wait (never a pass/fail timing criterion)


# librailwave as the build left it, for scripts that play a rank through ctypes.
LIBRAILWAVE = os.path.join(B, "lib", "librailwave.so.1")


class ClientOpts(ctypes.Structure):
    """ipc/railwave.h rw_client_opts_t, for rw_client_connect through ctypes."""
    _fields_ = [("socket_path", ctypes.c_char_p), ("group", ctypes.c_char_p),
                ("rank", ctypes.c_uint32), ("world_size", ctypes.c_uint32),
                ("node", ctypes.c_uint32), ("local_gpu", ctypes.c_int32),
                ("gpu_uuid", ctypes.c_uint8 * 16), ("sq_entries", ctypes.c_uint32),
                ("cq_entries", ctypes.c_uint32), ("timeout_ms", ctypes.c_int)]


SRC = os.path.dirname(B)  # the source tree this build was configured in


def define(path, name):
    """The integer of `#define NAME value` in the source file `path` (relative to the tree)."""
    with open(os.path.join(SRC, path)) as f:
        for line in f:
            if line.startswith("#define %s " % name):
                return int(line.split()[2], 0)
    raise RuntimeError("%s not in %s" % (name, path))


class Checks:
    """A test script's checks: check(cond, what) prints each as ok or FAIL and counts the
    failures; scenarios() runs (name, fn(tmp, seed)) pairs, an exception failing a check named
    for its scenario while the others still run; exit_code() is the script's (0 or 1)."""

    def __init__(self):
        self.fails = []

    def __call__(self, cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            self.fails.append(what)

    def scenarios(self, items, tmp, seed):
        for name, fn in items:
            try:
                fn(tmp, seed)
            except Exception as e:  # counted; the other scenarios still run
                self(False, "%s: %s" % (name, e))

    def exit_code(self):
        if self.fails:
            print("%d check(s) failed" % len(self.fails))
        return 1 if self.fails else 0

    def run(self, c, fn):
        """A script's body fn() on Cluster c: a RuntimeError fails a check; c.finish() at the
        end (the logs kept when a check failed). Returns exit_code()."""
        try:
            fn()
        except RuntimeError as e:
            self(False, str(e))
        finally:
            c.finish(self.fails)
        return self.exit_code()


def test_seed():
    """The run's seed: RW_TEST_SEED, else one drawn from the clock; printed first so that a
    failure replays."""
    seed = int(os.environ.get("RW_TEST_SEED", "0") or 0) or int(time.time()) % (1 << 30)
    print("seed %d (RW_TEST_SEED=%d reproduces)" % (seed, seed))
    return seed


def picked(items, prefix):
    """(name, fn, tmp) for each (name, fn) of items that RW_IT_ONLY names (a comma list; all when
    unset), each with a fresh temporary directory (prefix) that goes once the caller moves on."""
    only = os.environ.get("RW_IT_ONLY", "")
    for name, fn in items:
        if only and name not in only.split(","):
            continue
        with tempfile.TemporaryDirectory(prefix=prefix, dir="/tmp") as tmp:
            yield name, fn, tmp


def built(*paths):
    """True when every one of paths (default: railwaved, rw_rank, railwave) is executable."""
    return all(os.access(p, os.X_OK) for p in (paths or (DAEMON, RANK, RAILWAVE)))


FAKE_COUNT_KEYS = ("host_fn", "kernel", "work", "word_write", "word_wait", "work_run")


def fake_cuda_counts(folder, pid):
    """The stand-in driver's counts of process pid under $RW_FAKE_CUDA_COUNTS=folder
    (tests/cuda/fake_cuda_base.h rw_fake_count): all zero if it asked nothing of the GPU yet."""
    try:
        with open(os.path.join(folder, str(pid)), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return dict.fromkeys(FAKE_COUNT_KEYS, 0)
    if len(raw) != 8 * len(FAKE_COUNT_KEYS):
        raise RuntimeError("counts of pid %d: %d bytes, not %d"
                           % (pid, len(raw), 8 * len(FAKE_COUNT_KEYS)))
    return dict(zip(FAKE_COUNT_KEYS, struct.unpack("<%dQ" % len(FAKE_COUNT_KEYS), raw)))


def railwave_size(hidden, topk, experts, tokens, gpus, nodes, rails, *extra):
    """`railwave size` for a shape and cluster (docs/service.md "Turning on the rank path"):
    (exit code, {key: MiB} of its value lines, stderr)."""
    p = subprocess.run([RAILWAVE, "size", "--hidden", str(hidden), "--topk", str(topk),
                        "--experts", str(experts), "--tokens", str(tokens), "--gpus", str(gpus),
                        "--nodes", str(nodes), "--rails", str(rails)] + list(extra),
                       capture_output=True, text=True)
    keys = dict(ln.split() for ln in p.stdout.splitlines() if ln and not ln.startswith("#"))
    return p.returncode, {k: int(v) for k, v in keys.items()}, p.stderr


def wait_for(cond, wait=WAIT, what=None):
    """Polls cond() until it holds (True) or `wait` seconds passed (False; with `what`, a string
    or a function that makes one then, printed as what it gave up waiting for)."""
    deadline = time.time() + wait
    while not cond():
        if time.time() > deadline:
            if what:
                print("gave up waiting %.0f s for %s" % (wait, what() if callable(what) else what))
            return False
        time.sleep(0.05)
    return True


def read_until(proc, text):
    """Reads proc's output (a pipe) line by line until one holds `text`: True, or False at its
    end."""
    for ln in iter(proc.stdout.readline, b""):
        if text in ln.decode():
            return True
    return False


def still_running(procs, watch_s=1.0):
    """True when none of the processes `procs` ((name, Popen) pairs) exited within watch_s
    seconds. An absence can only be watched for a while: call it once what would end them
    wrongly has already happened (an answer a defect would send is sent by then), so such a
    process exits well within the watch; passing never depends on its length."""
    deadline = time.time() + watch_s
    while time.time() < deadline:
        if any(p.poll() is not None for _, p in procs):
            return False
        time.sleep(0.05)
    return all(p.poll() is None for _, p in procs)


def fds_named(pid, prefix):
    """How many of process pid's fds link to a name that starts with `prefix` (e.g. a memfd's
    "/memfd:NAME")."""
    n = 0
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            n += os.readlink("/proc/%d/fd/%s" % (pid, fd)).startswith(prefix)
        except OSError:
            pass
    return n


def maps_named(pid, name):
    """How many of process pid's mappings name `name`."""
    with open("/proc/%d/maps" % pid) as f:
        return sum(name in line for line in f)


def slab_objects(out):
    """{rail: object} from the "slab RAIL object INODE bytes B" lines of rw_rank --slabs."""
    objs = {}
    for line in out.splitlines():
        w = line.split()
        if len(w) == 6 and w[0] == "slab" and w[2] == "object":
            objs[int(w[1])] = int(w[3])
    return objs


def remote_rows(out):
    """rw_rank --slabs' count of rows from other nodes found in its group's slabs; -1: none said."""
    for line in out.splitlines():
        if line.endswith("remote rows seen in the group's slabs"):
            return int(line.split(", ")[-1].split()[0])
    return -1


def print_failure(name, e):
    """A scenario's failure: each line of what failed (not the daemons' logs that follow it) as
    a FAIL line of its own, so that tests/run's summary shows every failing rank, then the whole
    message."""
    lines = [l for l in str(e).splitlines() if l.strip() and not re.match(r"\s*d\d+\| ", l)]
    for l in lines[:12]:
        print("FAIL %s: %s" % (name, l.strip()[:300]))
    print(str(e))


def outputs(procs, wait=WAIT):
    """Wait for (rank, process) pairs (one past the bound `wait`, seconds each, is killed):
    rank -> (exit code, its output)."""
    res = {}
    for r, p in procs:
        try:
            out, _ = p.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        res[r] = (p.returncode, out.decode())
    return res


def free_ports(ip, n):
    """n distinct TCP ports free on ip just now (all bound at once, then released)."""
    ss = [socket.socket() for _ in range(n)]
    for s in ss:
        s.bind((ip, 0))
    ports = [s.getsockname()[1] for s in ss]
    for s in ss:
        s.close()
    return ports


def free_port(ip):
    """A TCP port free on ip just now (bound and released)."""
    return free_ports(ip, 1)[0]


def ask_stats(path, cmd="stats"):
    """One command on a railwaved stats socket; its reply block (ends with an empty line)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(path)
    s.sendall(cmd.encode() + b"\n")
    out = b""
    while not out.endswith(b"\n\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
    s.close()
    return out.decode()


def cpu_seconds(pid):
    """A process's user + system CPU time so far, seconds."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid):
    """A process's resident set (VmRSS), KiB; 0 if it has none."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Cluster:
    """`nodes` daemons described by one cluster file in tmp (logs d<n>.log beside it), started
    with start()/start_all() and stopped with stop(), which requires every daemon to exit 0.
    path: the daemons' --path; experts: E (default nodes * gpus * 2); extra: keys that override
    the cluster file's; gpus: ranks per node; rails: rails per node; cuda_ranks: None (host buffers), a stand-in
    libcuda to load in every rank ("--cuda" on RW_CUDA_DRIVER), "real" (the system's driver) or a
    RankPath; daemon: the railwaved binary to run. stop() appends each running daemon's last
    `stats` to d<n>.stats beside its log."""

    def __init__(self, tmp, nodes, path="auto", experts=None, extra=None, gpus=GPUS, rails=RAILS,
                 cuda_ranks=None, daemon=DAEMON):
        self.tmp, self.nodes, self.path, self.gpus, self.daemon = tmp, nodes, path, gpus, daemon
        self.rails = rails
        self.experts = experts or nodes * gpus * 2
        self.procs = {}
        self.env = dict(os.environ)
        self.node_env = {}  # node -> extra environment of that daemon only
        self.rank_flags = []
        self.rank_path = cuda_ranks if isinstance(cuda_ranks, RankPath) else None
        driver = self.rank_path.driver if self.rank_path else cuda_ranks
        if cuda_ranks and not self.rank_path:
            self.rank_flags = ["--cuda"]
        if driver and driver != "real":
            self.env["RW_CUDA_DRIVER"] = driver
        cfg = {
            "cluster": "it", "transport": "tcp", "gpus_per_node": gpus,
            "control_port": 7400, "rail_port": 7500,
            "phase_timeout_ms": 8000, "heartbeat_interval_ms": 100,
            "heartbeat_timeout_ms": 1000, "recv_region_mib": 16, "http": "0",
            "log_level": "info", "nodes": [],
        }
        # Peers authenticate with a key made for this run (docs/security.md), as deployed ones do.
        cfg["key_file"] = os.path.join(tmp, "cluster.key")
        if self.rank_path:
            cfg.update(group_area_mib=self.rank_path.area_mib,
                       group_pool_mib=self.rank_path.pool_mib)
        subprocess.run([RAILWAVE, "keygen", "--force", cfg["key_file"]], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cfg.update(extra or {})
        for n in range(nodes):
            cfg["nodes"].append({
                "name": "n%d" % n,
                "ipc_socket": os.path.join(tmp, "n%d.sock" % n),
                "stats_socket": os.path.join(tmp, "n%d.stats" % n),
            })
        self.cfg = cfg
        self.cfg_path = os.path.join(tmp, "cluster.json")
        self.pick_ports()

    def pick_ports(self):
        """Free ports for every node's control and rail addresses, and the cluster file rewritten.
        A port is free when picked; another process may take it before the daemon binds it:
        start_all() then picks again (a daemon exits 2 naming the port in use). The control
        address and rail 0's are the same IP: their ports are picked together, so they differ
        (picked one after the other, the kernel once gave both the same: the daemon refused the
        cluster file, "duplicate address")."""
        for n, node in enumerate(self.cfg["nodes"]):
            ctl = "127.0.0.%d" % (n + 1)
            ctl_port, rail0_port = free_ports(ctl, 2)
            node["control"] = "%s:%d" % (ctl, ctl_port)
            node["rails"] = [{"address": "127.0.%d.%d" % (r, n + 1),
                              "port": rail0_port if r == 0 else
                              free_port("127.0.%d.%d" % (r, n + 1))}
                             for r in range(self.rails)]
        self.write_config()

    def write_config(self):
        """(Re)writes the cluster file from self.cfg (after a test changed it)."""
        with open(self.cfg_path, "w") as f:
            json.dump(self.cfg, f)

    def start(self, n):
        log = open(os.path.join(self.tmp, "d%d.log" % n), "a")
        env = dict(self.env)
        env.update(self.node_env.get(n, {}))
        self.procs[n] = subprocess.Popen(
            [self.daemon, "--config", self.cfg_path, "--node", str(n), "--path", self.path],
            stdout=log, stderr=subprocess.STDOUT, env=env)

    def start_all(self):
        for attempt in range(3):
            for n in range(self.nodes):
                self.start(n)
            taken = self.wait_mesh(give_up_on_port_taken=attempt < 2)
            if not taken:
                return
            # A port picked free was taken before its daemon bound it: every daemon goes, and
            # the cluster starts again on new ports (the others were told the old ones).
            for n in range(self.nodes):
                self.kill(n)
            self.pick_ports()

    def stats(self, n, cmd="stats"):
        return ask_stats(self.cfg["nodes"][n]["stats_socket"], cmd)

    def summary(self, n):
        """Daemon n's `stats` as {key: the rest of its line} ("gpus_stalled": "1 0")."""
        return {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] if " " in ln else ""
                for ln in self.stats(n).splitlines()}

    def phases_passed(self, n, path, kind):
        """Daemon n's `stats phases` line of (path, kind) when phases of it passed and none
        failed; else None."""
        for ln in self.stats(n, "stats phases").splitlines():
            if ln.startswith("path=%s kind=%s " % (path, kind)):
                return ln if " ok=0 " not in ln and " failed=0 " in ln else None
        return None

    def rail_stats(self, n):
        """`stats rails` of daemon n as one {counter: number} dict per rail."""
        return [{k: float(v) for k, v in (w.split("=", 1) for w in line.split() if "=" in w)}
                for line in self.stats(n, "stats rails").splitlines() if line.startswith("rail=")]

    def port_taken(self):
        """True when a daemon exited at start because one of its ports was in use."""
        for n, p in self.procs.items():
            if p.poll() == 2:
                with open(os.path.join(self.tmp, "d%d.log" % n)) as f:
                    if "the port is in use" in f.read():
                        return True
        return False

    def wait_mesh(self, nodes=None, give_up_on_port_taken=False):
        """Until every node of `nodes` (default all) sees every other node up. With
        give_up_on_port_taken, returns True as soon as a daemon exited on a port in use."""
        nodes = range(self.nodes) if nodes is None else nodes
        deadline = time.time() + WAIT
        while time.time() < deadline:
            if give_up_on_port_taken and self.port_taken():
                return True
            try:
                if all(self.stats(n, "stats peers").count("state=up") == self.nodes - 1
                       for n in nodes):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("mesh did not come up\n" + self.logs())

    def kill(self, n, sig=signal.SIGKILL):
        self.procs[n].send_signal(sig)
        self.procs[n].wait()
        del self.procs[n]

    def stop(self):
        """SIGTERM every daemon; each must exit 0 (ASan: no leak, no error)."""
        bad = []
        for n in sorted(self.procs):
            try:
                last = self.stats(n)
            except OSError:
                continue
            with open(os.path.join(self.tmp, "d%d.stats" % n), "a") as f:
                f.write(last)
        for n, p in sorted(self.procs.items()):
            p.send_signal(signal.SIGTERM)
        for n, p in sorted(self.procs.items()):
            try:
                rc = p.wait(WAIT)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = "hang"
            if rc != 0:
                bad.append((n, rc))
        self.procs = {}
        if bad:
            raise RuntimeError("daemons exited badly: %s\n%s" % (bad, self.logs()))

    def log(self, n):
        """Daemon n's whole log so far."""
        with open(os.path.join(self.tmp, "d%d.log" % n)) as f:
            return f.read()

    def finish(self, failed):
        """A script's end: every daemon still running killed; the logs printed and the temporary
        folder kept when a check `failed`, else the folder removed."""
        for n in list(self.procs):
            self.kill(n)
        if failed:
            print("logs kept in %s\n%s" % (self.tmp, self.logs()))
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def logs(self):
        """The last 25 lines of every daemon's log, for a failure message."""
        out = []
        for n in range(self.nodes):
            path = os.path.join(self.tmp, "d%d.log" % n)
            if os.path.exists(path):
                with open(path) as f:
                    lines = f.read().splitlines()
                out += ["  d%d| %s" % (n, l) for l in lines[-25:]]
        return "\n".join(out)

    def rank(self, r, group, layers, steps, seed, mode="ok", flags=(), env=None):
        """Starts rw_rank for global rank r (tests/integration/rw_rank.c: MODE ok|fail|idle)."""
        node = r // self.gpus
        return subprocess.Popen(
            [RANK, self.cfg["nodes"][node]["ipc_socket"], group, str(r), str(self.nodes),
             str(self.gpus), str(self.experts), str(layers), str(steps), str(seed), mode]
            + list(self.rank_flags) + (self.rank_path.flags(r) if self.rank_path else [])
            + list(flags),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env or self.env)

    def pagerank(self, r, group, layers, steps, seed, mode, env=None):
        """Starts rw_pagerank for global rank r (tests/integration/rw_pagerank.c: a rank on the
        rank path, page or host, in its MODE)."""
        return subprocess.Popen(
            [PAGERANK, self.cfg["nodes"][r // self.gpus]["ipc_socket"], group, str(r),
             str(self.nodes), str(self.gpus), str(self.experts), str(layers), str(steps),
             str(seed), mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=env or self.env)

    def collect(self, procs, want=0):
        """Wait for (rank, process) pairs; each must exit `want`. Returns their outputs."""
        fails, outs = [], {}
        for r, (rc, out) in outputs(procs).items():
            outs[r] = out
            if rc != want:
                fails.append("rank %d rc %s: %s" % (r, rc, out.strip()[-400:]))
        if fails:
            raise RuntimeError("\n".join(fails) + "\n" + self.logs())
        return outs

    def run_ranks(self, group, layers, steps, seed, ranks=None, flags=()):
        """Every rank (or those of `ranks`) runs the workload; each must pass (exit 0)."""
        ranks = range(self.nodes * self.gpus) if ranks is None else ranks
        return self.collect([(r, self.rank(r, group, layers, steps, seed, flags=flags))
                             for r in ranks])


# ---- a hung GPU: the CUDA stand-in's hang switch (svc_gpuhang, svc_drainstop) ----

class HangSwitch:
    """The CUDA stand-in's hang switch in daemon `node` of Cluster c (RW_FAKE_CUDA_HANG=FILE:
    while FILE exists none of that process's stream work runs, as on a GPU whose copy engine is
    wedged or whose kernel never ends; tests/cuda/fake_cuda_base.c) and that daemon's stand-in
    counts (RW_FAKE_CUDA_COUNTS), both under tmp. Made before c starts; `env`: more of that
    daemon's own environment."""

    def __init__(self, c, tmp, node=0, env=None):
        self.c, self.node = c, node
        self.path = os.path.join(tmp, "hang")
        self.folder = os.path.join(tmp, "counts")
        os.mkdir(self.folder)
        c.node_env[node] = dict(env or {}, RW_FAKE_CUDA_HANG=self.path,
                                RW_FAKE_CUDA_COUNTS=self.folder)

    def on(self):
        open(self.path, "w").close()

    def off(self):
        os.unlink(self.path)

    def is_on(self):
        return os.path.exists(self.path)

    def release(self):
        """Off, if on (a scenario's end, whatever happened)."""
        if self.is_on():
            self.off()

    def counts(self):
        """The daemon's stand-in counts now (fake_cuda_counts)."""
        return fake_cuda_counts(self.folder, self.c.procs[self.node].pid)

    def wait_marked(self, since, marks):
        """Until the daemon queued `marks` more marks (host functions on its streams) than in the
        counts `since`: each local rank's staging ends with one on its GPU's stream, so a mark
        per local rank says every one of them was staged, whether or not the switch lets the
        copies run. False after WAIT."""
        return wait_for(lambda: self.counts()["host_fn"] - since["host_fn"] >= marks,
                        what=lambda: "%d marks on node %d's streams since %s (%s)"
                        % (marks, self.node, since, self.counts()))

    def wait_ran(self):
        """Until every item of stream work the daemon asked for ran (with the switch off: on, the
        queued work waits). False after WAIT."""
        def ran():
            k = self.counts()
            return k["work_run"] == k["work"]
        return wait_for(ran, what=lambda: "node %d's stream work to run (%s)"
                        % (self.node, self.counts()))


def hang_cluster(tmp, extra, driver=FAKE_CUDA, gpu_carve_outs=False):
    """Two daemons on the CUDA stand-in `driver` (theirs and their ranks'), node 0's with a
    HangSwitch under tmp. gpu_carve_outs: the groups' carve-outs in GPU memory the
    daemons' CPUs cannot read (RAILWAVE_TEST_GPUDIRECT=1 and the stand-in's discrete GPU,
    RW_FAKE_CUDA_VMM_NOCPU=1, as svc_slabs' pulled scenario), so every check of a GPU group reads
    headers the daemon pulls out of GPU 0 by copies on its own stream. Returns (cluster,
    switch), not started."""
    c = Cluster(tmp, 2, extra=extra)
    c.env.update(RW_CUDA_DRIVER=driver)
    env0 = {}
    if gpu_carve_outs:
        c.env.update(RAILWAVE_TEST_GPUDIRECT="1")
        env0["RW_FAKE_CUDA_VMM_NOCPU"] = "1"
        c.node_env[1] = {"RW_FAKE_CUDA_VMM_NOCPU": "1"}
    return c, HangSwitch(c, tmp, 0, env0)


def held_cuda_job(c, hang, check, group, seed):
    """A job of CUDA ranks (rw_rank --cuda, MODE fail, one step) whose pairs fail while node 0's
    staging hangs: the switch on, every rank submits, node 0 stages each of its ranks (its marks
    counted), node 1's first rank is killed, node 1's other ranks fail at once, and node 0 holds
    its ranks' staging for the hung copies (stats gpu_held_bytes). Each step is a `check`.
    Returns node 0's rank processes ((rank, Popen) pairs), not answered yet unless a defect did,
    and how many of the stand-in's mappings node 0 had before the job."""
    world, g = c.nodes * c.gpus, c.gpus
    maps0 = maps_named(c.procs[0].pid, "rw-fake-cuda")
    since = hang.counts()
    hang.on()
    ranks = [(r, c.rank(r, group, 1, 1, seed, mode="fail", flags=["--cuda"]))
             for r in range(world)]
    check(all(read_until(p, "submitted") for _, p in ranks), "%s: every rank submitted" % group)
    check(hang.wait_marked(since, g), "%s: node 0 staged its %d ranks' inputs" % (group, g))
    ranks[g][1].kill()  # node 1's first rank: both nodes' pairs fail
    res1 = outputs(ranks[g + 1:])
    check(all(v[0] == 0 and "failed as expected" in v[1] for v in res1.values()),
          "%s: node 1's other ranks failed at once: %s" % (group, res1))
    check(wait_for(lambda: int(c.summary(0).get("gpu_held_bytes", "0")) > 0,
                   what="node 0 to hold the staging"),
          "%s: node 0 holds its ranks' staging for the hung copies" % group)
    return ranks[:g], maps0
