#!/usr/bin/python3
"""What an operator and a trainer see when something is set up wrong, on real railwaved
processes (docs/service.md "Flags and environment", "Configuration"):
  * a cluster file whose node has a typo ("rail" for "rails") names the unknown key, exit 2;
  * start-up failures a restart cannot fix exit 2 (the unit does not restart them): a rail port
    another daemon holds (the message says the port is in use), a key file that is not a key or
    does not exist, a verbs rail on a host without that RDMA device (the message names the rail's
    address as an address and lists this host's RDMA devices, or says there are none);
  * a missing anchor table is "no table: Joint" with a warning, the daemon serves; --dump-config
    opens the table: missing is a warning (exit 0), one for another cluster is an error (exit 2);
  * a trainer rank whose world size is not the cluster's gets RW_E_WORLD_MISMATCH (not a closed
    connection), and the daemon's log gives the cluster file's shape; a rank of another node gets
    RW_E_NODE_MISMATCH, the log naming its node; the daemon serves on.
Exit 0 pass, 1 fail, 77 skip."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # build/ or build-asan/
SRC = os.path.dirname(B)
DAEMON = os.path.join(B, "railwaved")
TOOL = os.path.join(B, "tools", "railwave")
fails = []


def check(cond, what):
    print("%s %s" % ("ok  " if cond else "FAIL", what))
    if not cond:
        fails.append(what)


def port(ip):
    s = socket.socket()
    s.bind((ip, 0))
    p = s.getsockname()[1]
    s.close()
    return p


def cluster(tmp, **extra):
    nodes = [{"name": "n%d" % i, "control": "127.0.0.%d:%d" % (i + 1, port("127.0.0.%d" % (i + 1))),
              "rails": ["127.0.%d.%d:%d" % (r, i + 1, port("127.0.%d.%d" % (r, i + 1)))
                        for r in range(2)]} for i in range(2)]
    cfg = {"cluster": "errs", "transport": "tcp", "gpus_per_node": 2, "http": "0",
           "ipc_socket": tmp + "/{node}.sock", "stats_socket": tmp + "/{node}.stats",
           "recv_region_mib": 4, "nodes": nodes}
    cfg.update(extra)
    return cfg


def write(path, doc):
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def run(args, timeout=10):
    """railwaved that is expected to exit: (status, stderr)."""
    r = subprocess.run([DAEMON] + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True, timeout=timeout)
    return r.returncode, r.stderr


class Daemon:
    def __init__(self, tmp, cfg_path, node, extra=()):
        self.log = open(os.path.join(tmp, "%s.log" % node), "w+")
        self.p = subprocess.Popen([DAEMON, "--config", cfg_path, "--node", node] + list(extra),
                                  stdout=self.log, stderr=subprocess.STDOUT)
        self.stats = os.path.join(tmp, "%s.stats" % node)
        deadline = time.time() + 20
        while not os.path.exists(self.stats) and self.p.poll() is None and time.time() < deadline:
            time.sleep(0.05)

    def text(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            self.p.wait(20)
        self.log.close()


def stat(sock, key):
    out = subprocess.run([TOOL, "stats", "--socket", sock], capture_output=True, text=True).stdout
    for line in out.splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return v
    return None


def main():
    if not os.access(DAEMON, os.X_OK):
        print("SKIP: build railwaved first")
        return 77
    tmp = tempfile.mkdtemp(prefix="rwerrs.")
    live = []
    try:
        # ---- configuration: a typo is named ----
        cfg = cluster(tmp)
        cfg["nodes"][1]["rail"] = cfg["nodes"][1].pop("rails")
        rc, err = run(["--config", write(tmp + "/typo.json", cfg), "--node", "n0"])
        check(rc == 2 and "nodes[1].rail: unknown field" in err,
              "a node's 'rail' typo is named as the unknown key, exit 2: rc %d: %s" % (rc, err.strip()))

        # ---- start-up failures a restart cannot fix: exit 2 ----
        path = write(tmp + "/c.json", cluster(tmp))
        a = Daemon(tmp, path, "n0")
        live.append(a)
        check(a.p.poll() is None, "the first daemon runs")
        rc, err = run(["--config", path, "--node", "n0", "--ipc-socket", tmp + "/x.sock",
                       "--stats-socket", tmp + "/x.stats"])
        check(rc == 2 and "the port is in use" in err,
              "a rail port another daemon holds: exit 2, said so: rc %d: %s" % (rc, err.strip()[-300:]))
        bad = tmp + "/bad.key"
        with open(bad, "w") as f:
            f.write("zz\n")
        os.chmod(bad, 0o600)
        for key, needle in ((bad, "does not hold one key"), (tmp + "/none.key", "No such file")):
            rc, err = run(["--config", path, "--node", "n1", "--key-file", key])
            check(rc == 2 and needle in err, "key file %s: exit 2: rc %d: %s" % (
                os.path.basename(key), rc, err.strip()[-200:]))
        rc, err = run(["--config", path, "--node", "n1", "--transport", "verbs"])
        devs = sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []
        want = ("RDMA devices here: " + ", ".join(devs)) if devs else "RDMA devices here: none"
        check(rc == 2 and "cannot open the verbs rail at address 127.0.0.2 (nodes[1].rails[0])" in err
              and want in err, "verbs without that device: exit 2, the address called an address, "
              "the host's devices listed: rc %d: %s" % (rc, err.strip()[-400:]))

        # ---- the anchor table: missing = Joint with a warning; --dump-config opens it ----
        missing = tmp + "/anchors-missing.json"
        path_m = write(tmp + "/m.json", cluster(tmp, anchors=missing))
        rc, err = run(["--config", path_m, "--node", "n0", "--dump-config"])
        check(rc == 0 and "no such file" in err, "--dump-config, table missing: exit 0 with a "
              "warning: rc %d: %s" % (rc, err.strip()))
        other = write(tmp + "/anchors-other.json", {
            "schema_version": 1, "fingerprint": {"nodes": 4, "gpus_per_node": 8, "rails": 8,
                                                 "nic_gbps": 400.0, "transport": "verbs"},
            "max_size_ratio": 4, "shape_tolerance": 0.15, "anchors": []})
        path_o = write(tmp + "/o.json", cluster(tmp, anchors=other))
        rc, err = run(["--config", path_o, "--node", "n0", "--dump-config"])
        check(rc == 2 and "calibrated for another cluster" in err,
              "--dump-config opens the table: another cluster's is an error: rc %d: %s" % (rc, err.strip()))
        a.stop()
        live.remove(a)
        m0 = Daemon(tmp, path_m, "n0")
        m1 = Daemon(tmp, path_m, "n1")
        live += [m0, m1]
        subprocess.run([TOOL, "wait", "--quiet", "--socket", m0.stats, "--timeout", "20"])
        check(m0.p.poll() is None and "does not exist: running without a table, the selector "
              "uses Joint" in m0.text(), "a missing table: the daemon runs, with a warning")
        check(stat(m0.stats, "anchors") == "none", "... and no table (stats anchors: %s)" % stat(m0.stats, "anchors"))

        # ---- a trainer rank that does not fit the cluster is told why ----
        try:
            sys.path.insert(0, os.path.join(SRC, "python"))
            os.environ["RAILWAVE_LIB"] = os.path.join(B, "lib")
            import railwave
        except Exception as e:  # noqa: BLE001 (no torch: the rest still ran)
            print("note: the railwave package cannot be imported here (%s); ranks not checked" % e)
            railwave = None
        if railwave is not None:
            sock = tmp + "/n0.sock"
            for world, node, code, needle in (
                    (6, 0, "RW_E_WORLD_MISMATCH", "the cluster's"),
                    (4, 0, None, None)):
                try:
                    g = railwave.Group("w%d" % world, 0, world, sock, node=node, timeout=10)
                    g.close()
                    got = "joined"
                except railwave.RailWaveError as e:
                    got = str(e)
                if code:
                    check(code in got and needle in got, "world %d: %s with the cluster's shape: %s"
                          % (world, code, got))
                else:
                    check(got == "joined", "the right world size joins after it: %s" % got)
            try:
                railwave.Group("wn", 2, 4, sock, node=0, timeout=10).close()
                got = "joined"
            except railwave.RailWaveError as e:
                got = str(e)
            check("RW_E_NODE_MISMATCH" in got, "a rank of another node: RW_E_NODE_MISMATCH: %s" % got)
            check("world size 6, but the cluster file has 2 nodes x 2 GPUs per node = 4 ranks in "
                  "every group" in m0.text(), "the daemon's log blames the cluster file's shape")
            check("rank 2 is on node 1 of the cluster file (2 GPUs per node), and this daemon is "
                  "node 0" in m0.text(), "... and names the node a misplaced rank belongs to")
            check(m0.p.poll() is None, "the daemon serves on")
    finally:
        for d in live:
            d.stop()
        subprocess.run(["rm", "-rf", tmp])
    print("%d failed" % len(fails))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
