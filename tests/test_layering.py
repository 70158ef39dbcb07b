#!/usr/bin/env python3
"""Every file of RailWave uses the files below it and none above, and no two files use each other.

C: the objects of the modules (common, sched, rdma, ipc, cuda, rank, service with its folders, tools)
are read with nm; object A depends on object B when A uses a function or object B defines. The
test fails, naming every circle, when objects depend on each other in a circle; when a unit (a
module, or a folder of service/) uses a unit above it in the order below; or when units depend
on each other in a circle (ipc and cuda, service/mesh and service/mover sit side by side).
Inside service/ a file may include, of another folder, only that folder's face header, and only
of a folder below its own. Python: the modules of python/railwave depend on each other through
their imports (every import in the file, function-level ones too; an import under
`if TYPE_CHECKING:` names a type for annotations and calls nothing, so it is left out); the test
fails naming every import circle. A self-test on synthetic nm output and synthetic sources runs
first and proves that a circle and a wrong-way use are caught. ALLOWED_USES names, with the
reason, the uses left out of the circle check while a known circle waits to be broken.
Run by tests/run as $b/test/layering; exits 0 pass, 1 fail, 77 skip (nothing built)."""
import ast
import os
import re
import subprocess
import sys

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # build/ or build-asan/
SRC = os.path.dirname(B)

# The order, lowest first. Units of equal rank may not use each other in a circle.
MODULE_RANK = {"common": 0, "sched": 1, "rdma": 2, "ipc": 3, "cuda": 3, "rank": 4, "service": 5,
               "tools": 6}
SERVICE_RANK = {"core": 0, "phase": 1, "mesh": 2, "mover": 2, "exec": 3, "main": 4}
SERVICE_FACE = {"core": "svc.h", "phase": "phase.h", "mesh": "mesh.h", "mover": "mover.h",
                "exec": "exec.h"}
SKIP_DIRS = {"pic", "bench"}  # position-independent copies of module objects; benchmark programs

# Uses left out of the circle check, each a known circle still to be broken: {(object, regular
# expression every symbol of the use must match): why}. A use listed here is still checked for
# direction. Empty once the tree has no circle.
ALLOWED_USES = {}


def unit_of(obj):
    """'service/mesh' for service/mesh/mesh.o, 'service/main' for service/main.o, else the
    module."""
    parts = obj.split("/")
    if parts[0] == "service":
        return "service/" + (parts[1] if len(parts) > 2 else os.path.splitext(parts[1])[0])
    return parts[0]


def rank_of(unit):
    if unit.startswith("service/"):
        return (MODULE_RANK["service"], SERVICE_RANK[unit.split("/", 1)[1]])
    return (MODULE_RANK[unit], 0)


def has_source(obj):
    """An object of a source file of the tree (or one the build generated): not a partial link
    of other objects (rdma/verbs_all.o) and not one left behind by a file that moved or went."""
    stem = obj[:-2]
    return any(os.path.exists(os.path.join(root, stem + ext))
               for root in (SRC, B) for ext in (".c", ".cu"))


def parse_nm(text):
    defined, used = set(), set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TDRBCVW":
            defined.add(parts[2])
        elif len(parts) == 2 and parts[0] in "Uw":
            used.add(parts[1])
    return defined, used


def object_graph(nm_by_obj):
    """{obj: set of objs it uses}, {(obj, obj it uses): the symbols}, and a list of symbols that
    several objects define and some other object uses (the graph cannot tell which is meant: a
    finding of its own)."""
    defs, uses = {}, {}
    for o, text in nm_by_obj.items():
        defs[o], uses[o] = parse_nm(text)
    owners = {}
    for o, ds in defs.items():
        for s in ds:
            owners.setdefault(s, set()).add(o)
    graph, why, ambiguous = {}, {}, []
    for o in nm_by_obj:
        graph[o] = set()
        for s in sorted(uses[o]):
            who = owners.get(s, set()) - {o}
            if len(who) == 1:
                graph[o] |= who
                why.setdefault((o, min(who)), []).append(s)
            elif len(who) > 1:
                ambiguous.append("%s uses %s, defined by %s" % (o, s, ", ".join(sorted(who))))
    return graph, why, sorted(ambiguous)


def circles(graph):
    """The strongly connected components with more than one node (Tarjan, iterative), each as
    (sorted members, one cycle through them as a list that starts and ends at the same node)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    n = stack.pop()
                    on.discard(n)
                    comp.append(n)
                    if n == node:
                        break
                if len(comp) > 1:
                    out.append((sorted(comp), cycle_in(graph, set(comp))))
    return sorted(out)


def cycle_in(graph, comp):
    """A shortest way from the smallest member back to itself inside the component (BFS)."""
    start = min(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt_frontier = []
        for n in frontier:
            for m in sorted(graph[n]):
                if m == start:
                    path = [n]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if m in comp and m not in prev:
                    prev[m] = n
                    nxt_frontier.append(m)
        frontier = nxt_frontier
    return [start]


def allowed(obj, symbols):
    """Why the use of `symbols` by `obj` is left out of the circle check, or None."""
    for (o, pattern), reason in ALLOWED_USES.items():
        if o == obj and all(re.fullmatch(pattern, s) for s in symbols):
            return reason
    return None


def check_objects(nm_by_obj):
    """Findings (lines) for one object set; nm_by_obj maps 'module/.../x.o' to nm -g output."""
    found = []
    graph, why, ambiguous = object_graph(nm_by_obj)
    for line in ambiguous:
        found.append("symbol defined twice: " + line)
    checked = {a: {b for b in bs if not allowed(a, why[(a, b)])} for a, bs in graph.items()}
    for a, bs in sorted(graph.items()):
        for b in sorted(bs - checked[a]):
            print("note: %s uses %s (%s), left out of the circle check: %s"
                  % (a, b, " ".join(why[(a, b)]), allowed(a, why[(a, b)])))
    for comp, cyc in circles(checked):
        uses = ["\n    %s uses %s: %s" % (a, b, " ".join(why[(a, b)][:4])
                                          + (" ..." if len(why[(a, b)]) > 4 else ""))
                for a in comp for b in sorted(checked[a]) if b in comp]
        found.append("files call each other in a circle: %s%s" % (" -> ".join(cyc), "".join(uses)))
    units = {}
    for a, bs in graph.items():
        for b in bs:
            ua, ub = unit_of(a), unit_of(b)
            if ua == ub:
                continue
            units.setdefault(ua, set()).add(ub)
            if rank_of(ub) > rank_of(ua):
                found.append("%s (%s) uses %s (%s), a unit above it" % (a, ua, b, ub))
    for u in list(units):
        for v in units[u]:
            units.setdefault(v, set())
    for comp, cyc in circles(units):
        found.append("units use each other in a circle: %s" % " -> ".join(cyc))
    return found, graph, checked


def python_imports(pkg, sources):
    """{module: set of modules of the package it imports}; sources maps 'name' (no .py;
    '__init__' for the package) to its text."""
    mods = set(sources)
    graph = {m: set() for m in mods}

    def target(name):
        return name if name in mods else "__init__"

    for m, text in sources.items():
        tree = ast.parse(text, filename=m + ".py")
        skip = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                for sub in node.body:
                    skip.update(id(n) for n in ast.walk(sub))
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                if ((node.level == 1 and node.module is None)
                        or (node.level == 0 and node.module == pkg)):
                    for a in node.names:
                        graph[m].add(target(a.name))
                elif node.level == 1 or (node.level == 0 and node.module
                                         and node.module.startswith(pkg + ".")):
                    sub = node.module if node.level == 1 else node.module[len(pkg) + 1:]
                    graph[m].add(target(sub.split(".")[0]))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == pkg:
                        graph[m].add("__init__")
                    elif a.name.startswith(pkg + "."):
                        graph[m].add(target(a.name.split(".")[1]))
        graph[m].discard(m)
    return graph


def check_python(pkg, sources):
    graph = python_imports(pkg, sources)
    return ["python modules import each other in a circle: %s" %
            " -> ".join("%s.%s" % (pkg, n) for n in cyc) for _, cyc in circles(graph)], graph


INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"service/([a-z_]+)/([A-Za-z0-9_.]+)"', re.M)


def check_includes(files):
    """files maps 'service/<folder>/x.c' (or service/main.c) to its text."""
    found = []
    for path, text in sorted(files.items()):
        mine = unit_of(path).split("/", 1)[1]
        for folder, header in INCLUDE_RE.findall(text):
            if folder == mine:
                continue
            if folder not in SERVICE_FACE:
                found.append("%s includes service/%s/%s: no such folder" % (path, folder, header))
            elif header != SERVICE_FACE[folder]:
                found.append("%s includes service/%s/%s, not that folder's face (%s)"
                             % (path, folder, header, SERVICE_FACE[folder]))
            elif SERVICE_RANK[folder] >= SERVICE_RANK[mine]:
                found.append("%s includes service/%s/%s from a folder not below it"
                             % (path, folder, header))
    return found


def self_test():
    """The checks catch what they exist for, on made-up input."""
    ok = True

    def nm(defs, uses):
        return "\n".join(["0000 T " + d for d in defs] + ["                 U " + u for u in uses])
    circle = {"rdma/tcp.o": nm(["rw_tcp_a"], ["rw_tcp_io_b"]),
              "rdma/tcp_io.o": nm(["rw_tcp_io_b"], ["rw_tcp_a", "rw_log"]),
              "common/log.o": nm(["rw_log"], [])}
    found, _, _ = check_objects(circle)
    if not any("circle: rdma/tcp.o -> rdma/tcp_io.o -> rdma/tcp.o" in f for f in found):
        print("self-test FAIL: a two-file circle was not named: %s" % found)
        ok = False
    three = {"cuda/driver.o": nm(["d"], ["k"]), "cuda/kernels.o": nm(["k"], ["s"]),
             "cuda/stream.o": nm(["s"], ["d"]), "cuda/other.o": nm(["o"], ["d"])}
    found, _, _ = check_objects(three)
    if not any("cuda/driver.o -> cuda/kernels.o -> cuda/stream.o -> cuda/driver.o" in f
               for f in found):
        print("self-test FAIL: a three-file circle was not named: %s" % found)
        ok = False
    upward = {"common/log.o": nm(["rw_log"], ["rw_sched_x"]), "sched/x.o": nm(["rw_sched_x"], []),
              "service/core/stats.o": nm(["st"], ["ex"]), "service/exec/exec.o": nm(["ex"], []),
              "service/mesh/mesh.o": nm(["me"], ["mo"]), "service/mover/m.o": nm(["mo"], ["me2"]),
              "service/mesh/mesh2.o": nm(["me2"], [])}
    found, _, _ = check_objects(upward)
    want = ["common/log.o (common) uses sched/x.o (sched), a unit above it",
            "service/core/stats.o (service/core) uses service/exec/exec.o (service/exec), a unit",
            "units use each other in a circle: service/mesh -> service/mover -> service/mesh"]
    for w in want:
        if not any(w in f for f in found):
            print("self-test FAIL: not found %r in %s" % (w, found))
            ok = False
    table = {"rdma/rail.o": nm(["rw_rail_addr_parse"], ["rw_rail_tcp_ops", "tcp_helper"]),
             "rdma/tcp.o": nm(["rw_rail_tcp_ops", "tcp_helper"], ["rw_rail_addr_parse"])}
    found, _, _ = check_objects(table)
    if not any("rdma/rail.o -> rdma/tcp.o -> rdma/rail.o" in f for f in found):
        print("self-test FAIL: a use beyond the allowed symbols was left out: %s" % found)
        ok = False
    clean = {"common/log.o": nm(["rw_log"], []), "sched/x.o": nm(["rw_sched_x"], ["rw_log"])}
    found, _, _ = check_objects(clean)
    if found:
        print("self-test FAIL: a clean set gave findings: %s" % found)
        ok = False
    py = {"__init__": "from .group import Group\n",
          "group": "def f():\n    from . import autograd\n",
          "autograd": "from .group import BACKWARD\n", "core": "import os\n",
          "typed": ("from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from .group import G\n"),
          "group2": "from railwave.typed import x\n"}
    found, _ = check_python("railwave", py)
    if found != ["python modules import each other in a circle: "
                 "railwave.autograd -> railwave.group -> railwave.autograd"]:
        print("self-test FAIL: python import circle: %s" % found)
        ok = False
    inc = {"service/core/stats.c": '#include "service/exec/exec.h"\n',
           "service/exec/exec.c": ('#include "service/mesh/mesh_int.h"\n'
                                   '#include "service/mesh/mesh.h"\n')}
    found = check_includes(inc)
    if len(found) != 2 or "not below" not in found[0] or "not that folder's face" not in found[1]:
        print("self-test FAIL: includes: %s" % found)
        ok = False
    return ok


def main():
    if not self_test():
        return 1
    nm_by_obj = {}
    for mod in MODULE_RANK:
        top = os.path.join(B, mod)
        for d, dirs, files in os.walk(top):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
            for f in files:
                p = os.path.join(d, f)
                rel = os.path.relpath(p, B)
                if f.endswith(".o") and has_source(rel):
                    nm_by_obj[rel] = subprocess.run(["nm", "-g", p], capture_output=True,
                                                    text=True, check=True).stdout
    if len([o for o in nm_by_obj if o.startswith("service/")]) < 10:
        print("skip: the objects are not built (%s)" % B)
        return 77
    found, graph, checked = check_objects(nm_by_obj)
    edges = sum(len(v) for v in graph.values())
    left_out = edges - sum(len(v) for v in checked.values())

    files = {}
    for d, _, fs in os.walk(os.path.join(SRC, "service")):
        for f in fs:
            if f.endswith((".c", ".h")):
                p = os.path.join(d, f)
                with open(p) as fh:
                    files[os.path.relpath(p, SRC)] = fh.read()
    found += check_includes(files)

    pkg_dir = os.path.join(SRC, "python", "railwave")
    sources = {}
    for f in sorted(os.listdir(pkg_dir)):
        if f.endswith(".py"):
            with open(os.path.join(pkg_dir, f)) as fh:
                sources[f[:-3]] = fh.read()
    py_found, py_graph = check_python("railwave", sources)
    found += py_found

    for f in found:
        print("FAIL: " + f)
    if found:
        return 1
    print("ok: %d objects in %d units, %d one-way dependencies, no circle (%d uses left out "
          "by the allow-list), none upward; "
          "%d service files include only faces of folders below; %d python modules, "
          "%d imports, no circle" % (len(nm_by_obj), len({unit_of(o) for o in nm_by_obj}), edges,
                                     left_out,
                                     len(files), len(sources),
                                     sum(len(v) for v in py_graph.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
