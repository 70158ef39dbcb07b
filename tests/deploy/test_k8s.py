#!/usr/bin/env python3
"""deploy/k8s checked as the cluster would take it, without a cluster: the manifests are parsed
(PyYAML) and the fields that decide whether railwaved runs right are checked against the rest
of the project rather than against copies of their values:
  * DaemonSet: OnDelete updates; probes /healthz (startup, liveness) and /ready (readiness) on
    the named port that RAILWAVE_HTTP listens on; non-root as the image's user, seccomp
    RuntimeDefault, drop ALL (+ IPC_LOCK only), no privilege escalation, read-only root; the
    GPU runtimeClassName and an rdma/ resource limit; a grace period covering the drain bound;
    the ConfigMap mounted whole (cluster.json, and anchors.json once calibrated), the args naming
    both; a missing anchors.json is a warning (no table: Joint), not a refusal;
  * every RAILWAVE_* variable is one railwaved knows (its --help), the socket is librailwave's
    default (ipc/railwave.h), and the real daemon accepts the manifest's args and environment
    (--dump-config against the example cluster);
  * PodMonitor: selects the DaemonSet's pods, scrapes its "metrics" port at /metrics; the job
    label its scrape yields (the Prometheus Operator's naming: namespace/name, jobLabel, then the
    endpoint's relabelings) is run through promtool against deploy/prometheus/railwave.rules.yml:
    RailwaveDaemonDown fires for a target of that job that stops answering;
  * namespace.yaml: the DaemonSet's namespace, with the Pod Security level its host namespaces
    and hostPath need (privileged); the image's uid outside systemd's DynamicUser range and
    Debian's system and regular ranges; image tags = VERSION; .containerignore keeps build trees,
    .venv and .git out of the image's context, .gitignore keeps .venv out of git;
  * Containerfile: Debian images, scripts/install, the uid the DaemonSet runs as, and a runtime
    stage installing the package of every library the built railwaved links (objdump + dpkg).
Exits 0 pass, 1 fail, 77 skip (no PyYAML or no railwaved)."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.dirname(B)
K8S = os.path.join(SRC, "deploy", "k8s")
DAEMON = os.path.join(B, "railwaved")
fails = []
# A target of the PodMonitor's job stops answering at minute 2: pending at 2, firing from 3.
DOWN_TEST = """rule_files: [%s]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'up{job="%s",instance="10.0.0.1:9470"}'
        values: '1 1 0x6'
    alert_rule_test:
      - eval_time: 2m
        alertname: RailwaveDaemonDown
        exp_alerts: []
      - eval_time: 4m
        alertname: RailwaveDaemonDown
        exp_alerts:
          - exp_labels: {severity: critical, job: "%s", instance: "10.0.0.1:9470"}
            exp_annotations:
              summary: "railwaved on 10.0.0.1:9470 is not answering scrapes"
"""


def check(cond, what):
    if not cond:
        fails.append(what)
    return cond


def main():
    try:
        import yaml
    except ImportError:
        print("SKIP: no PyYAML (scripts/setup installs python3-yaml)")
        return 77
    if not os.access(DAEMON, os.X_OK):
        print("SKIP: build railwaved first")
        return 77
    ds = yaml.safe_load(open(os.path.join(K8S, "railwaved-daemonset.yaml")))
    pm = yaml.safe_load(open(os.path.join(K8S, "railwaved-podmonitor.yaml")))
    cf = open(os.path.join(K8S, "Containerfile")).read()

    # ---- the image: uid, install path, runtime libraries ----
    uid = re.search(r"useradd .*--uid (\d+)", cf)
    gid = re.search(r"groupadd .*--gid (\d+) (\S+)", cf)
    check(uid and gid, "Containerfile: no railwave user/group with fixed ids")
    uid, gid, group = int(uid.group(1)), int(gid.group(1)), gid.group(2)
    froms = re.findall(r"^FROM (\S+)", cf, re.M)
    check(froms and all(f.startswith("debian:") for f in froms), "Containerfile: non-Debian base %s" % froms)
    check("sh scripts/install" in cf and "PREFIX=/usr" in cf, "Containerfile does not use scripts/install")
    check(re.search(r"^USER %d:%d$" % (uid, gid), cf, re.M), "Containerfile: USER is not railwave")
    check('ENTRYPOINT ["/usr/sbin/railwaved"]' in cf, "Containerfile: entrypoint is not the installed daemon")
    runtime = cf.split("FROM ")[-1]
    pkgs = set(re.findall(r"\b(lib[a-z0-9.+-]+|ibverbs-providers)\b", runtime))
    needed = re.findall(r"NEEDED\s+(\S+)", subprocess.run(["objdump", "-p", DAEMON],
                        capture_output=True, text=True).stdout)
    check(needed, "objdump found no NEEDED entries")
    for lib in needed:
        if lib.startswith(("libc.so", "libm.so", "ld-linux")):
            continue  # libc6: in every Debian image
        if lib.startswith(("libasan.", "libubsan.")):
            continue  # this is the sanitizer build; the image builds the release one
        r = subprocess.run(["dpkg", "-S", lib], capture_output=True, text=True)
        owners = {l.split(":")[0] for l in r.stdout.splitlines() if "/" + lib in l}
        check(owners & pkgs, "Containerfile runtime stage lacks the package of %s (%s)" % (lib, owners or "?"))
    check("ibverbs-providers" in pkgs, "no ibverbs-providers: libibverbs finds no NIC driver")

    # ---- DaemonSet ----
    check(ds["apiVersion"] == "apps/v1" and ds["kind"] == "DaemonSet", "not an apps/v1 DaemonSet")
    check(ds["spec"]["updateStrategy"] == {"type": "OnDelete"}, "updateStrategy is not OnDelete")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    check(ds["spec"]["selector"]["matchLabels"].items() <= labels.items(), "selector does not match the pods")
    pod = ds["spec"]["template"]["spec"]
    check(pod.get("hostNetwork") is True, "hostNetwork off: the rails are host interfaces")
    check(pod.get("runtimeClassName"), "no runtimeClassName for the GPU runtime")
    psc = pod.get("securityContext", {})
    check(psc.get("runAsNonRoot") is True and psc.get("runAsUser") == uid and psc.get("runAsGroup") == gid,
          "pod does not run as the image's railwave user %d:%d: %s" % (uid, gid, psc))
    check(psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", "seccomp is not RuntimeDefault")
    (c,) = [c for c in pod["containers"] if c["name"] == "railwaved"]
    sc = c.get("securityContext", {})
    check(sc.get("capabilities", {}).get("drop") == ["ALL"], "capabilities not drop [ALL]")
    check(set(sc.get("capabilities", {}).get("add", [])) <= {"IPC_LOCK"}, "capabilities beyond IPC_LOCK")
    check(sc.get("allowPrivilegeEscalation") is False, "privilege escalation allowed")
    check(sc.get("readOnlyRootFilesystem") is True, "root filesystem writable")
    check("privileged" not in sc or sc["privileged"] is False, "privileged container")
    for ic in pod.get("initContainers", []):
        isc = ic.get("securityContext", {})
        check(isc.get("capabilities", {}).get("drop") == ["ALL"] and isc.get("allowPrivilegeEscalation") is False,
              "init container %s not locked down" % ic["name"])
        check(ic["image"] == c["image"], "init container %s uses another image" % ic["name"])
    limits = c["resources"]["limits"]
    check(any(k.startswith("rdma/") for k in limits), "no rdma/ device plugin resource in limits")

    env = {e["name"]: e for e in c["env"]}
    known = set(re.findall(r"\[(RAILWAVE_[A-Z_]+)\]", subprocess.run(
        [DAEMON, "--help"], capture_output=True, text=True).stdout))
    check("RAILWAVE_SOCKET" in known, "railwaved --help lists no RAILWAVE_SOCKET")
    for name in env:
        if name.startswith("RAILWAVE_"):
            check(name in known, "%s is not a variable railwaved reads" % name)
    check(env.get("RAILWAVE_NODE", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName",
          "RAILWAVE_NODE is not the Kubernetes node name")
    default_sock = re.search(r'#define RW_DEFAULT_SOCKET "([^"]+)"',
                             open(os.path.join(SRC, "ipc", "railwave.h")).read()).group(1)
    check(env.get("RAILWAVE_SOCKET", {}).get("value") == default_sock,
          "RAILWAVE_SOCKET is not librailwave's default %s" % default_sock)
    check(env.get("RAILWAVE_IPC_GROUP", {}).get("value") == group, "socket group is not %s" % group)
    http = env.get("RAILWAVE_HTTP", {}).get("value", "")
    m = re.fullmatch(r"\$\(HOST_IP\):(\d+)", http)
    check(m and "HOST_IP" in env, "RAILWAVE_HTTP is not HOST_IP:PORT: %r" % http)
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    check(m and ports.get("metrics") == int(m.group(1)), "port 'metrics' is not RAILWAVE_HTTP's port")
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/ready")):
        g = c.get(probe, {}).get("httpGet", {})
        check(g.get("path") == path and g.get("port") in ("metrics", ports.get("metrics")),
              "%s is not GET %s on the metrics port: %s" % (probe, path, c.get(probe)))
    # Every key of the ConfigMap is a file (no items list): anchors.json may be absent on a first
    # deploy (no calibration yet), which the daemon runs as "no table: Joint"; an items list
    # naming a missing key would keep the pod from starting.
    cfg = next((v for v in pod["volumes"] if "configMap" in v), None)
    check(cfg and "items" not in cfg["configMap"], "the ConfigMap volume lists items: a missing anchors.json would stop the pod")
    mount = next((vm["mountPath"] for vm in c["volumeMounts"] if cfg and vm["name"] == cfg["name"]), None)
    args = c.get("args", [])
    for flag, key in (("--config", "cluster.json"), ("--anchors", "anchors.json")):
        check(flag in args and mount and args[args.index(flag) + 1] == "%s/%s" % (mount, key),
              "%s does not name the mounted %s" % (flag, key))
    run = next((v for v in pod["volumes"] if v.get("hostPath", {}).get("path") == os.path.dirname(default_sock)), None)
    check(run and any(vm["name"] == run["name"] and vm["mountPath"] == os.path.dirname(default_sock)
                      for vm in c["volumeMounts"]), "the host's socket folder is not mounted")
    # The drain bound of the example cluster (phase_timeout_ms + 1 s) must fit the grace period.
    example = os.path.join(SRC, "deploy", "clusters", "example-verbs-8x8.json")
    r = subprocess.run([DAEMON, "--config", example, "--node", "0", "--dump-config"], capture_output=True, text=True)
    pt = int(re.search(r'"phase_timeout_ms": (\d+)', r.stdout).group(1))
    check(pod.get("terminationGracePeriodSeconds", 30) >= pt / 1000 + 1 + 4,
          "terminationGracePeriodSeconds below the drain bound %g s + teardown" % (pt / 1000 + 1))

    # The real daemon takes these args and this environment (files mapped to the example cluster,
    # the anchor table absent as on a first deploy: a warning, not a refusal).
    files = {"%s/cluster.json" % mount: example,
             "%s/anchors.json" % mount: os.path.join(SRC, "deploy", "anchors", "not-calibrated-yet.json")}
    dargs = [files.get(a, a) for a in args]
    denv = {k: v for k, v in os.environ.items() if not k.startswith("RAILWAVE_")}
    for name, e in env.items():
        if "value" in e:
            denv[name] = e["value"].replace("$(HOST_IP)", "127.0.0.1")
    denv["RAILWAVE_NODE"] = "gpu01"
    r = subprocess.run([DAEMON] + dargs + ["--dump-config"], capture_output=True, text=True, env=denv)
    check(r.returncode == 0, "railwaved refuses the manifest's args/env: %s" % r.stderr.strip())
    check("no such file; the daemon would run without a table" in r.stderr,
          "no warning for the missing anchor table: %s" % r.stderr.strip())
    check('"http": "127.0.0.1:9470"' in r.stdout and '"ipc_socket": "%s"' % default_sock in r.stdout,
          "the manifest's environment did not take effect: %s" % r.stdout[:300])

    # ---- PodMonitor ----
    check(pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["kind"] == "PodMonitor", "not a PodMonitor")
    check(pm["metadata"]["namespace"] == ds["metadata"]["namespace"], "PodMonitor in another namespace")
    check(pm["spec"]["selector"]["matchLabels"].items() <= labels.items(), "PodMonitor selects other pods")
    eps = pm["spec"]["podMetricsEndpoints"]
    check(any(e.get("port") == "metrics" and e.get("path", "/metrics") == "/metrics" for e in eps),
          "PodMonitor does not scrape port 'metrics' at /metrics")

    # ---- the PodMonitor's job label against the alert rules (promtool) ----
    ep = next((e for e in eps if e.get("port") == "metrics"), {})
    job = "%s/%s" % (pm["metadata"]["namespace"], pm["metadata"]["name"])   # the operator's default
    if pm["spec"].get("jobLabel"):
        job = labels.get(pm["spec"]["jobLabel"], job)
    for r in ep.get("relabelings", []):
        if r.get("targetLabel") == "job" and not r.get("sourceLabels") and \
                r.get("action", "replace") == "replace":
            job = r.get("replacement", "$1")
    check(job == "railwave", "the PodMonitor's scrape gets job=%r" % job)
    promtool = shutil.which("promtool")
    if not promtool:
        check(False, "no promtool (scripts/setup installs prometheus)")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            test = os.path.join(tmp, "down.test.yml")
            with open(test, "w") as f:
                f.write(DOWN_TEST % (os.path.join(SRC, "deploy", "prometheus", "railwave.rules.yml"),
                                     job, job))
            r = subprocess.run([promtool, "test", "rules", test], capture_output=True, text=True)
            check(r.returncode == 0, "RailwaveDaemonDown does not fire for the PodMonitor's job %r: %s"
                  % (job, (r.stdout + r.stderr).strip()[-600:]))

    # ---- namespace, uid, version, image context ----
    ns = yaml.safe_load(open(os.path.join(K8S, "namespace.yaml")))
    check(ns.get("kind") == "Namespace" and ns["metadata"]["name"] == ds["metadata"]["namespace"],
          "namespace.yaml is not the DaemonSet's namespace")
    host = pod.get("hostNetwork") or pod.get("hostIPC") or any("hostPath" in v for v in pod["volumes"])
    check(not host or ns["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce") == "privileged",
          "the namespace's Pod Security level does not admit hostNetwork/hostIPC/hostPath")
    check(60000 <= uid < 61184, "uid %d lies in a system, regular or DynamicUser range" % uid)
    version = open(os.path.join(SRC, "VERSION")).read().strip()
    tags = set(re.findall(r"railwaved:([\w.-]+)", cf + open(os.path.join(K8S, "railwaved-daemonset.yaml")).read()))
    check(tags == {version}, "image tags %s, VERSION %s" % (sorted(tags), version))
    ci = open(os.path.join(SRC, ".containerignore")).read().split()
    for entry in ("build", "build-*", ".venv", ".git"):
        check(entry in ci, ".containerignore does not leave out %s" % entry)
    check("/.venv/" in open(os.path.join(SRC, ".gitignore")).read().split(), ".gitignore does not leave out .venv")
    check("rw_bench_rank" in cf and re.search(r"^\s+python3 \\$", runtime, re.M),
          "the image lacks rw_bench_rank or python3 (railwave top, calibrate in the pod)")

    for f in fails:
        print("FAIL:", f)
    if not fails:
        print("k8s manifests: ok")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
