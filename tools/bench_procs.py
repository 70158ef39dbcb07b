"""The processes of `railwave demo` / `railwave bench` (tools/bench_bed.py): every child kept
so that all are killed whatever happens, the test bed (tests/testbed/testbed.sh) or loopback, one
railwaved per node for one contender, and the small statistics every report uses (pct, summary:
the type-7 quantiles sched/ uses)."""
import json
import os
import shutil
import signal
import socket
import subprocess
import time

WAIT = 300.0  # bound on any single wait; never a pass/fail criterion


def say(*a):
    print(*a, flush=True)


def pct(xs, q):
    """Percentile with linear interpolation (q in [0, 1])."""
    s = sorted(xs)
    if not s:
        return float("nan")
    i = q * (len(s) - 1)
    lo = int(i)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def summary(xs):
    return {"median": pct(xs, 0.5), "p10": pct(xs, 0.1), "p90": pct(xs, 0.9), "n": len(xs),
            "samples": [round(x, 6) for x in xs]}


class Procs:
    """Every child process we start, so that all of them can be killed whatever happens."""

    def __init__(self):
        self.live = []

    def spawn(self, argv, **kw):
        p = subprocess.Popen(argv, start_new_session=True, **kw)
        self.live.append(p)
        return p

    def forget(self, p):
        if p in self.live:
            self.live.remove(p)

    def kill_all(self):
        for p in self.live:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
        for p in self.live:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.live = []


class Bed:
    """The emulated cluster: network namespaces (test bed) or loopback addresses."""

    def __init__(self, args, procs, src):
        self.args, self.procs, self.src = args, procs, src
        self.tb = os.path.join(src, "tests", "testbed", "testbed.sh")
        self.prefix = args.prefix
        self.mode = None
        self.why = ""
        self.is_up = False

    def up(self):
        a = self.args
        if a.loopback:
            self.mode, self.why = "loopback", "--loopback given"
        elif os.geteuid() != 0:
            self.mode, self.why = "loopback", "not root: cannot create network namespaces"
        elif not (shutil.which("ip") and shutil.which("tc")):
            self.mode, self.why = "loopback", "no iproute2 (ip, tc)"
        else:
            r = subprocess.run(["sh", self.tb, "up", "-n", str(a.nodes), "-r", str(a.rails),
                                "-m", str(a.mbit), "-p", self.prefix],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.is_up = True  # down() also removes a half-built bed
            if r.returncode == 0:
                self.mode = "testbed"
            else:
                self.down()
                self.mode, self.why = "loopback", "test bed failed: " + r.stdout.strip()[-200:]
        return self.mode

    def down(self):
        if not self.is_up:
            return True
        subprocess.run(["sh", self.tb, "down", "-p", self.prefix], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        st = subprocess.run(["sh", self.tb, "status", "-p", self.prefix], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True).stdout.strip()
        self.is_up = bool(st)
        return not st

    def wrap(self, node, argv):
        if self.mode == "testbed":
            return ["ip", "netns", "exec", "%s-n%d" % (self.prefix, node)] + argv
        return argv

    def control(self, n):
        if self.mode == "testbed":
            return "10.78.0.%d:7400" % (n + 1)
        ip = "127.0.0.%d" % (n + 1)
        return "%s:%d" % (ip, free_port(ip))

    def rail(self, n, r):
        if self.mode == "testbed":
            return {"address": "10.77.%d.%d" % (r, n + 1), "port": 7500}
        ip = "127.0.%d.%d" % (r, n + 1)
        return {"address": ip, "port": free_port(ip)}


def free_port(ip):
    s = socket.socket()
    s.bind((ip, 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Daemons:
    """One railwaved per node for one contender (a forced path, or auto with a table)."""

    def __init__(self, ctx, tmp, path, region_mib, experts, anchors=None):
        self.ctx, self.tmp, self.path = ctx, tmp, path
        a = ctx.args
        self.n = a.nodes
        self.procs = []
        cfg = {
            "cluster": "testbed" if ctx.bed.mode == "testbed" else "loopback",
            "transport": "tcp", "gpus_per_node": a.gpus,
            "nic_gbps": a.mbit / 1000.0,
            "phase_timeout_ms": a.phase_timeout_ms, "heartbeat_interval_ms": 500,
            "heartbeat_timeout_ms": 15000, "recv_region_mib": region_mib,
            "http": "0", "log_level": "warn", "path": path,
            "anchors": anchors or "", "nodes": [],
        }
        for n in range(self.n):
            cfg["nodes"].append({
                "name": "node%d" % n, "control": ctx.bed.control(n),
                "rails": [ctx.bed.rail(n, r) for r in range(a.rails)],
                "ipc_socket": os.path.join(tmp, "node%d.sock" % n),
                "stats_socket": os.path.join(tmp, "node%d.stats" % n),
            })
        # Peers authenticate with a key made for this run (docs/security.md): the demo runs
        # the shipped, authenticated path.
        cfg["key_file"] = os.path.join(tmp, "cluster.key")
        subprocess.run([ctx.bin("railwave"), "keygen", "--force", cfg["key_file"]], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.cfg = cfg
        self.cfg_path = os.path.join(tmp, "cluster.json")
        with open(self.cfg_path, "w") as f:
            json.dump(cfg, f, indent=1)
        self.env = dict(os.environ)

    def start(self):
        for n in range(self.n):
            log = open(os.path.join(self.tmp, "railwaved.node%d.log" % n), "a")
            argv = self.ctx.bed.wrap(n, [self.ctx.bin("railwaved"), "--config", self.cfg_path,
                                         "--node", str(n)])
            self.procs.append(self.ctx.procs.spawn(argv, stdout=log, stderr=subprocess.STDOUT,
                                                   env=self.env))
            log.close()
        deadline = time.time() + 60
        while time.time() < deadline:
            for n, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise RuntimeError("railwaved on node %d exited (%d) at start:\n%s"
                                       % (n, p.returncode, self.log_tail(n)))
            try:
                if all(self.stats(n, "stats peers").count("state=up") == self.n - 1
                       for n in range(self.n)):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the daemons' mesh did not come up in 60 s\n" + self.log_tail(0))

    def stats(self, n, cmd):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        try:
            s.connect(self.cfg["nodes"][n]["stats_socket"])
            s.sendall(cmd.encode() + b"\n")
            out = b""
            while not out.endswith(b"\n\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        finally:
            s.close()
        return out.decode()

    def rail_tx(self):
        """tx_bytes[node][rail] from every daemon's counters."""
        out = []
        for n in range(self.n):
            row = {}
            for line in self.stats(n, "stats rails").splitlines():
                kv = dict(w.split("=", 1) for w in line.split() if "=" in w)
                if "rail" in kv and "tx_bytes" in kv:
                    row[int(kv["rail"])] = int(kv["tx_bytes"])
            out.append([row.get(r, 0) for r in range(self.ctx.args.rails)])
        return out

    def last_decision(self):
        for line in self.stats(0, "stats selector").splitlines():
            if line.startswith("decision "):
                return dict(w.split("=", 1) for w in line.split()[1:] if "=" in w)
        return {}

    def log_tail(self, n, lines=15):
        try:
            with open(os.path.join(self.tmp, "railwaved.node%d.log" % n)) as f:
                return "".join("  node%d| %s" % (n, l) for l in f.readlines()[-lines:])
        except OSError:
            return ""

    def cpu_seconds(self):
        """CPU time (user + system) the daemons have used so far, from /proc."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for p in self.procs:
            try:
                with open("/proc/%d/stat" % p.pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                pass
        return total

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        bad = []
        for n, p in enumerate(self.procs):
            try:
                rc = p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
            self.ctx.procs.forget(p)
            if rc != 0:
                bad.append("node%d exit %s" % (n, rc))
        self.procs = []
        return bad


class Ctx:
    def __init__(self, args, procs, bed, src):
        self.args, self.procs, self.bed, self.src = args, procs, bed, src
        self.build = args.build

    def bin(self, name):
        if name == "railwaved" and os.environ.get("RAILWAVE_DAEMON"):
            return os.environ["RAILWAVE_DAEMON"]  # another build of the daemon
        for p in (os.path.join(self.build, name), os.path.join(self.build, "tools", name),
                  os.path.join(self.build, "bin", name)):
            if os.access(p, os.X_OK):
                return p
        raise RuntimeError("%s not built in %s (run ninja)" % (name, self.build))
