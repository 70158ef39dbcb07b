"""The contenders of `railwave demo` / `railwave bench` and the bench report (tools/bench_bed.py):
what each path is, the tables of time / lower bound per point and phase, the targets, and the
files the bench writes (JSON, text, plot)."""
import json
import os
import shutil
import subprocess

from bench_procs import say

PATHS = ["native", "rail-only", "perm-only", "joint"]
WHAT = {
    "native": "every record on its owner GPU's rail, all destinations at once",
    "rail-only": "RailBalance over all rails, all destinations at once",
    "perm-only": "native rails, N-1 permutation waves",
    "joint": "RailBalance inside each of N-1 permutation waves",
    "auto": "the selector (anchor table calibrated in this run)",
    "mpi": "Open MPI MPI_Alltoallv, TCP BTL over every rail interface",
}
CONT = PATHS + ["auto", "mpi"]


def phase_table(doc, phase):
    """time / lower bound of every contender at every point, for one phase."""
    lines = ["%s time / lower bound (median; p10-p90 in brackets); lower bound = busiest NIC "
             "after the best per-pair balance / NIC rate" % phase]
    hdr = "%-11s %5s %5s %4s %8s" % ("axis", "rho_g", "kappa", "fan", "LB s")
    for c in CONT:
        hdr += " %17s" % c
    hdr += "  %-9s" % "selected"
    lines.append(hdr)
    for p in doc["points"]:
        f = p["features"]
        lb = p["lower_bound_s"][phase]
        s = "%-11s %5.2f %5.2f %4d %8.3f" % (p["axis"], f["rho_g"], f["kappa"], f["max_fan_in"], lb)
        for c in CONT:
            r = p["results"].get(c, {})
            if phase not in r:
                s += " %17s" % "-"
                continue
            d = r[phase]
            s += " %5.2f [%4.2f-%4.2f]" % (d["median"] / lb, d["p10"] / lb, d["p90"] / lb)
        s += "  %-9s" % p["results"].get("auto", {}).get("decision", {}).get("path", "-")
        lines.append(s)
    return lines


def bench_table(doc):
    lines = []
    for phase in ("dispatch", "combine"):
        lines += phase_table(doc, phase) + [""]
    del lines[-1]
    lines.append("")
    lines.append("ratios measured in the same run, per point (dispatch medians):")
    for p in doc["points"]:
        r = p["results"]
        med = {c: r[c]["dispatch"]["median"] for c in CONT if "dispatch" in r.get(c, {})}
        best = min(PATHS, key=lambda c: med[c])
        s = "  %-11s rho_g %4.2f: native/joint %5.2f" % (p["axis"], p["features"]["rho_g"],
                                                        med["native"] / med["joint"])
        if "mpi" in med:
            s += "  mpi/joint %5.2f" % (med["mpi"] / med["joint"])
        if "auto" in med:
            s += "  selector/best %5.3f (best %s)" % (med["auto"] / med[best], best)
        lines.append(s)
    lines += [""] + target_lines(doc)
    return "\n".join(lines) + "\n"


def target_lines(doc):
    """The targets of docs/perf/testbed.md "Against the targets", checked on this run's medians."""
    def ratio(p, c, phase):
        r = p["results"].get(c, {})
        return r[phase]["median"] / p["lower_bound_s"][phase] if phase in r else None

    skewed = [p for p in doc["points"] if p["features"]["rho_g"] >= 2.95]
    lines = ["targets on the %d points with rho_g >= 3 (medians):" % len(skewed)]
    for c in ("rail-only", "joint"):
        for phase in ("dispatch", "combine"):
            v = [ratio(p, c, phase) for p in skewed]
            v = [x for x in v if x is not None]
            if v:
                lines.append("  %-9s %-8s time / lower bound: worst %.2f, %d of %d within 1.15" % (
                    c, phase, max(v), sum(x <= 1.15 for x in v), len(v)))
    nj = [p["results"]["native"]["dispatch"]["median"] / p["results"]["joint"]["dispatch"]["median"]
          for p in skewed if "dispatch" in p["results"].get("native", {})]
    if nj:
        lines.append("  native / joint (dispatch): lowest %.2f, %d of %d at least 2" % (
            min(nj), sum(x >= 2 for x in nj), len(nj)))
    for phase in ("dispatch", "combine"):
        mj = [p["results"]["mpi"][phase]["median"] / p["results"]["joint"][phase]["median"]
              for p in doc["points"] if phase in p["results"].get("mpi", {})]
        if mj:
            lines.append("  mpi / joint (%s, all points): lowest %.2f, %d of %d above 1" % (
                phase, min(mj), sum(x > 1 for x in mj), len(mj)))
    uni = [p for p in doc["points"] if p["features"]["rho_g"] < 1.2 and "auto" in p["results"]]
    for p in uni:
        best = min(PATHS, key=lambda c: p["results"][c]["dispatch"]["median"])
        lines.append("  uniform point (rho_g %.2f): selector %s, %.3f x the best path (%s)" % (
            p["features"]["rho_g"], p["results"]["auto"].get("decision", {}).get("path", "-"),
            p["results"]["auto"]["dispatch"]["median"] / p["results"][best]["dispatch"]["median"],
            best))
    return lines


def write_bench(a, doc):
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, a.name)
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    text = bench_table(doc)
    with open(base + ".txt", "w") as f:
        f.write(text)
    say("")
    say(text)
    pts = [p for p in doc["points"] if p["axis"] == "rail-skew"]
    dat = base + ".dat"
    with open(dat, "w") as f:
        f.write("# rho_g " + " ".join(CONT) + "\n")
        for p in sorted(pts, key=lambda p: p["features"]["rho_g"]):
            lb = p["lower_bound_s"]["dispatch"]
            vals = []
            for c in CONT:
                r = p["results"].get(c, {})
                vals.append("%.4f" % (r["dispatch"]["median"] / lb) if "dispatch" in r else "NaN")
            f.write("%.3f %s\n" % (p["features"]["rho_g"], " ".join(vals)))
    if shutil.which("gnuplot"):
        plot = ["set terminal pngcairo size 900,560 font 'sans,11'",
                "set output '%s.png'" % base,
                "set title 'RailWave on the rail test bed: %d nodes x %d rails x %d Mbit/s, %d ranks/node'"
                % (doc["nodes"], doc["rails"], doc["mbit"], doc["gpus"]),
                "set xlabel 'source-rail skew rho_g (max / mean native NIC egress)'",
                "set ylabel 'dispatch time / lower bound'", "set key top left", "set grid",
                "set yrange [0:*]",
                "plot " + ", ".join("'%s' using 1:%d with linespoints lw 2 title '%s'"
                                    % (dat, i + 2, c if c != "auto" else "selector")
                                    for i, c in enumerate(CONT))]
        r = subprocess.run(["gnuplot"], input="\n".join(plot) + "\n", text=True,
                           stderr=subprocess.PIPE)
        if r.returncode != 0:
            say("gnuplot failed: " + r.stderr.strip())
        else:
            say("wrote %s.json, %s.txt, %s.png" % (base, base, base))
    os.remove(dat)


# ---------------------------------------------------------------------------------------------
