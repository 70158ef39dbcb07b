#!/usr/bin/env python3
"""The Grafana dashboard (deploy/grafana/railwave-dashboard.json) and the Prometheus alert rules
(deploy/prometheus/railwave.rules.yml) against what real railwaved daemons export: two daemons
with their metrics endpoint on loopback (tests/lib/cluster.py's Cluster), one
dispatch/combine run through them, then:

* the dashboard parses, panel ids are unique, every panel has a datasource and targets with an
  expression, its template variables query railwave_info;
* the rules parse, every rule has alert, expr, labels.severity and annotations.summary;
* every metric name either file uses is declared in the daemons' /metrics (a `# TYPE` line or a
  sample), and every label they group or join by is a label of some exported series (or
  instance/job/le, which Prometheus adds);
* promtool (Debian's prometheus package, installed by scripts/setup; its absence is a failure):
  `promtool check rules` passes; `promtool test rules` runs deploy/prometheus/railwave.rules.test.yml
  (peer down, rail down and phase failures fire on synthetic series, and only then); `promtool
  check metrics` finds nothing to fix in each daemon's real /metrics scrape (after phases ran).

Exit 0 pass, 1 fail, 77 skip."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.dirname(B)
sys.path.insert(0, os.path.join(B, "tests", "lib"))
import cluster  # noqa: E402  (the multi-daemon harness: tests/lib/cluster.py)
DASH = os.path.join(SRC, "deploy", "grafana", "railwave-dashboard.json")
RULES = os.path.join(SRC, "deploy", "prometheus", "railwave.rules.yml")
RULE_TESTS = os.path.join(SRC, "deploy", "prometheus", "railwave.rules.test.yml")
PROM_ADDED = {"instance", "job", "le"}


def exprs_of(dash, rules):
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append(("panel '%s'" % p["title"], t["expr"]))
    for g in rules["groups"]:
        for r in g["rules"]:
            out.append(("rule %s" % r["alert"], r["expr"]))
    return out


SCRAPES = []  # the raw /metrics texts, for promtool check metrics


def promtool_checks(promtool, fails):
    runs = [("check rules", [promtool, "check", "rules", RULES], None),
            ("test rules", [promtool, "test", "rules", os.path.basename(RULE_TESTS)], None)]
    runs += [("check metrics (node %d scrape, %d lines)" % (n, t.count("\n")),
              [promtool, "check", "metrics"], t) for n, t in enumerate(SCRAPES)]
    for what, argv, stdin in runs:
        p = subprocess.run(argv, input=stdin, capture_output=True, text=True,
                           cwd=os.path.dirname(RULE_TESTS))
        # check metrics exits 0 with lint findings on stdout/stderr: any output is a finding.
        out = (p.stdout + p.stderr).strip()
        if p.returncode != 0 or (stdin is not None and out):
            fails.append("promtool %s: %s" % (what, out[-800:]))
        else:
            print("ok   promtool %s" % what)


def scrape(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as f:
        text = f.read().decode()
    SCRAPES.append(text)
    names, labels = set(), set()
    for line in text.splitlines():
        t = re.match(r"# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (\w+)", line)
        if t:  # a declared family, maybe without samples yet (errors before the first error)
            names.add(t.group(1))
            if t.group(2) == "histogram":
                names |= {t.group(1) + x for x in ("_bucket", "_sum", "_count")}
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s", line)
        if m:
            names.add(m.group(1))
            for lab in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or ""):
                labels.add(lab)
    return names, labels


def main():
    try:
        import yaml
    except ImportError:
        print("skip: python3-yaml not installed (scripts/setup installs it)")
        return 77
    if not (os.access(cluster.DAEMON, os.X_OK) and os.access(cluster.RANK, os.X_OK)):
        print("skip: railwaved or rw_rank not built")
        return 77
    fails = []
    with open(DASH) as f:
        dash = json.load(f)
    with open(RULES) as f:
        rules = yaml.safe_load(f)
    ids = [p["id"] for p in dash["panels"]]
    if len(ids) != len(set(ids)):
        fails.append("dashboard: duplicate panel ids %s" % ids)
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        if not p.get("datasource") or not p.get("targets") or not all(t.get("expr") for t in p["targets"]):
            fails.append("dashboard: panel '%s' lacks a datasource or an expression" % p.get("title"))
    tmpl = [v for v in dash["templating"]["list"] if v["type"] == "query"]
    if not tmpl or not all("railwave_info" in v["query"] for v in tmpl):
        fails.append("dashboard: template variables do not query railwave_info")
    n_rules = 0
    for g in rules["groups"]:
        for r in g["rules"]:
            n_rules += 1
            for k in ("alert", "expr"):
                if not r.get(k):
                    fails.append("rules: a rule lacks '%s': %s" % (k, r))
            if not r.get("labels", {}).get("severity") or not r.get("annotations", {}).get("summary"):
                fails.append("rules: %s lacks labels.severity or annotations.summary" % r.get("alert"))

    with tempfile.TemporaryDirectory(prefix="rwdeploy.", dir="/tmp") as tmp:
        c = cluster.Cluster(tmp, 2, path="auto")
        ports = []
        for n in range(2):
            port = cluster.free_port("127.0.0.1")
            ports.append(port)
            c.cfg["nodes"][n]["http"] = "127.0.0.1:%d" % port
        with open(c.cfg_path, "w") as f:
            json.dump(c.cfg, f)
        try:
            c.start_all()
            c.run_ranks("g.deploy", layers=1, steps=2, seed=3)
            time.sleep(0.6)  # the endpoint serves a snapshot published every 250 ms
            names, labels = set(), set()
            for port in ports:
                nm, lb = scrape(port)
                names |= nm
                labels |= lb
        finally:
            c.stop()
    for where, e in exprs_of(dash, rules):
        for m in set(re.findall(r"\b(railwave_[a-z0-9_]+)", e)):
            if m not in names:
                fails.append("%s uses %s, which railwaved does not export" % (where, m))
        for grp in re.findall(r"\b(?:by|on|group_left|group_right|without)\s*\(([^)]*)\)", e):
            for lab in [x.strip() for x in grp.split(",") if x.strip()]:
                if lab not in labels and lab not in PROM_ADDED:
                    fails.append("%s groups by label '%s', which no exported series has" % (where, lab))
    for lab in ("cluster", "node"):
        if lab not in labels:
            fails.append("railwave_info has no '%s' label (the dashboard joins it)" % lab)
    promtool = shutil.which("promtool")
    if promtool:
        promtool_checks(promtool, fails)
    else:
        fails.append("promtool not installed (Debian's prometheus package; scripts/setup installs it)")
    for f in fails:
        print("FAIL " + f)
    if not fails:
        print("ok   dashboard (%d panels) and %d rules use only exported metrics and labels (%d names scraped)"
              % (len(dash["panels"]), n_rules, len(names)))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
