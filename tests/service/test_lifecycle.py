#!/usr/bin/env python3
"""railwaved's life as an operator and a service manager see it (docs/service.md "Readiness",
"Logs"): three real daemons on loopback, each with its HTTP endpoint, checked through /healthz,
/ready, the stats socket's `ready`, `railwave wait`, the Prometheus gauges, and sd_notify
messages read from a real $NOTIFY_SOCKET datagram socket (the protocol systemd speaks):

  * alone, node n0 is healthy but not ready: /ready 503 and `railwave wait` exit 1, both naming
    the missing peers; systemd hears READY=1 (serving) and a STATUS naming 0/2 peers;
  * with n1 and n2 up: `railwave wait` exit 0, /ready 200, `ready yes`, railwave_peers_up 2,
    railwave_build_info with the version, STATUS "ready", WATCHDOG=1 pings;
  * a wedged loop (test hook RAILWAVE_TEST_WEDGE_MS + SIGUSR1): /healthz turns 503 naming the
    silence and the watchdog pings stop while it lasts; both recover after;
  * n2 stopped with SIGTERM says goodbye: n0 logs "peer=n2: left (clean shutdown)" (not a
    failure); n1 killed with SIGKILL is logged as "peer=n1: down"; /ready names both;
  * SIGTERM to n0: STOPPING=1 with EXTEND_TIMEOUT_USEC = the drain bound + margin, exit 0;
  * log lines carry ISO-8601 UTC millisecond stamps and key=value context; under journald
    (JOURNAL_STREAM naming stderr) they carry a syslog priority prefix and no stamp.

Exits 0 pass, 1 fail, 77 skip."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DAEMON = os.path.join(B, "railwaved")
TOOL = os.path.join(B, "tools", "railwave")
sys.path.insert(0, os.path.join(B, "tests", "lib"))
from cluster import WAIT, free_port  # noqa: E402  (tests/lib/cluster.py)
PHASE_TIMEOUT_MS = 2000
WEDGE_MS = 3500
HEALTH_STALE_MS = 2000  # service/core/health.h RW_SVC_HEALTH_STALE_MS
STOP_MARGIN_MS = 4000   # service/core/health.h RW_SVC_HEALTH_STOP_MARGIN_MS
GPU_DRAIN_MS = 5000 + 2000  # gpu_stall_ms's default + service/core/svc.h RW_SVC_GPU_DRAIN_MARGIN_MS


def http(port, path):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def until(what, fn, bound=WAIT):
    deadline = time.time() + bound
    while time.time() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


class Notify:
    """A $NOTIFY_SOCKET: a thread collects every datagram with the time it came (systemd reads
    its socket at once too; an unread queue would block the daemon's sd_notify)."""
    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.msgs = []
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            with self.lock:
                self.msgs.append((time.time(), data.decode()))

    def drain(self):
        with self.lock:
            return list(self.msgs)

    def seen(self, needle):
        return any(needle in m for _, m in self.drain())

    def close(self):
        self.running = False
        self.thread.join()
        self.sock.close()


def main():
    if not (os.access(DAEMON, os.X_OK) and os.access(TOOL, os.X_OK)):
        print("SKIP: build railwaved and railwave first")
        return 77
    tmp = tempfile.mkdtemp(prefix="rwlife.")
    procs = {}
    notify = None
    try:
        nodes, http_port = [], {}
        for n in range(3):
            ip = "127.0.0.%d" % (n + 1)
            http_port[n] = free_port("127.0.0.1")
            nodes.append({"name": "n%d" % n, "control": "%s:%d" % (ip, free_port(ip)),
                          "rails": ["%s:%d" % (ip, free_port(ip)) for _ in range(2)],
                          "ipc_socket": os.path.join(tmp, "n%d.sock" % n),
                          "stats_socket": os.path.join(tmp, "n%d.stats" % n),
                          "http": "127.0.0.1:%d" % http_port[n]})
        cfg = {"cluster": "life", "transport": "tcp", "gpus_per_node": 2,
               "phase_timeout_ms": PHASE_TIMEOUT_MS, "heartbeat_interval_ms": 100,
               "heartbeat_timeout_ms": 1000, "recv_region_mib": 4, "nodes": nodes}
        cfg_path = os.path.join(tmp, "cluster.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        logs = {n: os.path.join(tmp, "n%d.log" % n) for n in range(3)}

        def log(n):
            with open(logs[n]) as f:
                return f.read()

        def start(n, env=None):
            e = dict(os.environ)
            e.pop("NOTIFY_SOCKET", None)
            e.pop("JOURNAL_STREAM", None)
            e.update(env or {})
            out = open(logs[n], "a")
            if "JOURNAL_STREAM" in e:  # the stream journald would hand us: this log file
                st = os.fstat(out.fileno())
                e["JOURNAL_STREAM"] = "%d:%d" % (st.st_dev, st.st_ino)
            procs[n] = subprocess.Popen([DAEMON, "--config", cfg_path, "--node", "n%d" % n],
                                        stdout=out, stderr=subprocess.STDOUT, env=e)

        def wait_tool(timeout):
            return subprocess.run([TOOL, "wait", "--socket", nodes[0]["stats_socket"],
                                   "--timeout", str(timeout)], capture_output=True, text=True)

        notify = Notify(os.path.join(tmp, "notify"))
        start(0, {"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "1000000",
                  "RAILWAVE_TEST_WEDGE_MS": str(WEDGE_MS)})
        try:
            until("READY=1", lambda: notify.seen("READY=1"))
        except AssertionError:
            raise AssertionError("no READY=1; notify thread alive %s, got %s, daemon rc %s" % (
                notify.thread.is_alive(), notify.drain(), procs[0].poll()))
        assert notify.seen("STATUS=waiting for peers: 0/2 peers up"), notify.msgs

        # Alone: healthy, not ready, and every interface says who is missing.
        until("n0 /healthz", lambda: http(http_port[0], "/healthz") == (200, "ok\n"))
        code, body = http(http_port[0], "/ready")
        assert code == 503 and "not ready: 0/2 peers up" in body, (code, body)
        assert "waiting peer=n1 state=" in body and "waiting peer=n2 state=" in body, body
        r = wait_tool(0.5)
        assert r.returncode == 1 and "waiting peer=n1" in r.stderr and "waiting peer=n2" in r.stderr, r
        r = subprocess.run([TOOL, "wait", "--socket", os.path.join(tmp, "none.stats"),
                            "--timeout", "0.2"], capture_output=True, text=True)
        assert r.returncode == 1 and "cannot connect" in r.stderr, r
        r = subprocess.run([TOOL, "wait", "--timeout", "soon"], capture_output=True, text=True)
        assert r.returncode == 2 and "--timeout" in r.stderr, r

        # The others come up; n2 logs as it would under journald.
        start(1)
        start(2, {"JOURNAL_STREAM": "set below"})
        r = wait_tool(WAIT)
        assert r.returncode == 0 and "ready after" in r.stdout, r
        # HTTP reads the published snapshot (at most RW_SVC_METRICS_PUBLISH_MS old).
        until("/ready 200", lambda: http(http_port[0], "/ready")[0] == 200)
        code, body = http(http_port[0], "/ready")
        assert body == "ready: 2/2 peers up\n", (code, body)
        r = subprocess.run([TOOL, "stats", "--socket", nodes[0]["stats_socket"], "ready"],
                           capture_output=True, text=True)
        assert r.stdout == "ready yes\nstate running\npeers_up 2/2\n", r
        code, metrics = http(http_port[0], "/metrics")
        version = open(os.path.join(os.path.dirname(B), "VERSION")).read().strip() \
            if os.path.exists(os.path.join(os.path.dirname(B), "VERSION")) else None
        assert "\nrailwave_peers_up 2\n" in metrics and "\nrailwave_peers_configured 2\n" in metrics
        m = re.search(r'\nrailwave_build_info\{version="([^"]+)"\} 1\n', metrics)
        assert m and (version is None or m.group(1) == version), m
        until("STATUS ready", lambda: notify.seen("STATUS=ready: 2/2 peers up on 2 rails"))
        until("WATCHDOG=1", lambda: notify.seen("WATCHDOG=1"))

        # A wedged loop: /healthz fails (the HTTP thread still answers), no watchdog pings.
        t_wedge = time.time()
        procs[0].send_signal(signal.SIGUSR1)
        code, body = until("/healthz 503", lambda: (lambda r: r if r[0] == 503 else None)(
            http(http_port[0], "/healthz")))
        assert "unhealthy: the loop has not ticked for" in body, body
        code, body = http(http_port[0], "/ready")
        assert code == 503 and "unhealthy" in body, (code, body)
        until("/healthz back", lambda: http(http_port[0], "/healthz")[0] == 200)
        until("watchdog back", lambda: any("WATCHDOG=1" in m and t > t_wedge + WEDGE_MS / 1e3 - 0.5
                                           for t, m in notify.drain()))
        pings = [t for t, m in notify.drain() if "WATCHDOG=1" in m and t > t_wedge]
        assert pings[0] - t_wedge > (WEDGE_MS - 500) / 1e3, ("pinged while wedged", pings[0] - t_wedge)

        # The wedge made the peers time n0 out; let the mesh form again first.
        r = wait_tool(WAIT)
        assert r.returncode == 0, r

        # A clean stop says goodbye; a crash does not.
        def peer_errors():
            r = subprocess.run([TOOL, "stats", "--socket", nodes[0]["stats_socket"], "stats",
                                "peers"], capture_output=True, text=True)
            return {k: int(v) for k, v in re.findall(r"name=(\S+) .*errors=(\d+)", r.stdout)}
        errs_before = peer_errors()
        before = len(log(0))
        procs[2].send_signal(signal.SIGTERM)
        assert procs[2].wait(WAIT) == 0, log(2)
        del procs[2]
        until("goodbye logged", lambda: "peer=n2: left (clean shutdown)" in log(0))
        assert "peer=n2: down" not in log(0)[before:], log(0)[before:]
        procs[1].kill()
        procs[1].wait()
        del procs[1]
        until("crash logged", lambda: "WARN peer=n1: down (" in log(0))
        # /ready names both (HTTP reads a snapshot up to 250 ms old: poll). The clean stop
        # counted no peer error; the crash did.
        until("/ready naming n1 and n2", lambda: (lambda r: r[0] == 503 and "waiting peer=n1 "
                                                   in r[1] and "waiting peer=n2 " in r[1])(
            http(http_port[0], "/ready")))
        errs = peer_errors()
        assert errs["n2"] == errs_before["n2"] and errs["n1"] > errs_before["n1"], (errs_before, errs)

        # Stop: STOPPING=1 with the drain bound, and exit 0.
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(WAIT) == 0, log(0)
        del procs[0]
        stop = "STOPPING=1\nEXTEND_TIMEOUT_USEC=%d" % ((PHASE_TIMEOUT_MS + 1000 + GPU_DRAIN_MS + STOP_MARGIN_MS) * 1000)
        assert notify.seen(stop), notify.msgs

        # Log format: ISO-8601 UTC ms + ident with node=; journald: priority prefix, no stamp.
        stamp = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z railwaved node=n0 "
                           r"(ERROR|WARN|INFO|DEBUG) ")
        lines = log(0).splitlines()
        assert lines and all(stamp.match(l) for l in lines), [l for l in lines if not stamp.match(l)]
        jl = log(2).splitlines()
        assert jl and all(re.match(r"^<[3467]>railwaved node=n2 ", l) for l in jl), jl
        assert any(l.startswith("<6>railwaved node=n2 running") for l in jl), jl
        assert any(l.startswith("<6>railwaved node=n2 peer=n0: up") for l in jl), jl
        print("lifecycle: ok")
        return 0
    except AssertionError as e:
        import traceback
        print("FAIL at line %d:" % traceback.extract_tb(e.__traceback__)[-1].lineno, e)
        for n in range(3):
            p = os.path.join(tmp, "n%d.log" % n)
            if os.path.exists(p):
                print("---- n%d log ----" % n)
                print(open(p).read()[-3000:])
        return 1
    finally:
        if notify:
            notify.close()
        for p in procs.values():
            p.kill()
            p.wait()
        subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    sys.exit(main())
