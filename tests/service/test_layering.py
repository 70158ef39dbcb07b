#!/usr/bin/env python3
"""The daemon's files call each other in one direction only (docs/dataflow.md "Phase
executor"): from every object file of service/ (and the files it links from the other modules'
archives) the symbols it defines and the ones it uses are read with nm; file A depends on file B
when A uses a function or object B defines. The test fails, naming the cycle, when any files of
service/ depend on each other in a circle, and names any service file over 800 lines.
Run by tests/run as $b/test/svc_layering; exits 0 pass, 1 fail, 77 skip."""
import os
import subprocess
import sys

B = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # build/ or build-asan/
SRC = os.path.dirname(B)


def symbols(obj):
    out = subprocess.run(["nm", "-g", obj], capture_output=True, text=True, check=True).stdout
    defined, used = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TDRB":
            defined.add(parts[2])
        elif len(parts) == 2 and parts[0] == "U":
            used.add(parts[1])
    return defined, used


def find_cycle(graph):
    """One cycle of the graph as a list of nodes, or None (iterative DFS, three colours)."""
    colour = {n: 0 for n in graph}
    for start in sorted(graph):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                colour[node] = 2
                continue
            if colour.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if colour.get(nxt) == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def main():
    objdir = os.path.join(B, "service")
    if not os.path.isdir(objdir):
        print("skip: no %s (build first)" % objdir)
        return 77
    objs = sorted(os.path.relpath(os.path.join(d, f), objdir) for d, _, fs in os.walk(objdir)
                  for f in fs if f.endswith(".o"))
    if len(objs) < 10:
        print("skip: the service objects are not built")
        return 77
    defs, uses = {}, {}
    for o in objs:
        defs[o], uses[o] = symbols(os.path.join(objdir, o))
    owner = {}
    for o, ds in defs.items():
        for s in ds:
            owner[s] = o
    graph = {o: {owner[s] for s in uses[o] if s in owner and owner[s] != o} for o in objs}
    failed = 0
    cycle = find_cycle(graph)
    if cycle:
        print("FAIL: service/ files call each other in a circle: %s" % " -> ".join(cycle))
        failed = 1
    edges = sum(len(v) for v in graph.values())
    long = []
    for f in sorted(os.path.relpath(os.path.join(d, g), os.path.join(SRC, "service"))
                    for d, _, gs in os.walk(os.path.join(SRC, "service")) for g in gs):
        if f.endswith((".c", ".h")):
            with open(os.path.join(SRC, "service", f)) as fh:
                n = sum(1 for _ in fh)
            if n > 800:
                long.append("%s (%d lines)" % (f, n))
    if long:
        print("FAIL: service files over 800 lines: %s" % ", ".join(long))
        failed = 1
    if not failed:
        print("ok: %d service objects, %d one-way dependencies between them, no circle, "
              "no file over 800 lines" % (len(objs), edges))
    return failed


if __name__ == "__main__":
    sys.exit(main())
