#!/usr/bin/env python3
"""The docs stand alone: every relative link of a Markdown file and every path under docs/ that a
file of the tree names (a comment, a docstring, a doc) resolves to a file of the tree, and so does
every source path a page of docs/ or the README names (service/mesh/mesh.c, tools/*.py; the dated
logs of docs/perf/runs/ keep the names of their day); a section named in quotes after a docs/ path
(docs/cuda.md "Where the slabs live") is a heading or a bold paragraph label of that file, and a
numbered one (docs/algorithms.md §2.5) a numbered heading; and
nothing cites a design file, a style guide or a tracker the repository does not hold ("DESIGN",
"STYLE.md", "issue N").
    tests/docs/check_links.py [SRCDIR]     (default: the tree this copy was built from)
Run by tests/run as $b/test/docs_links; exits 0 pass, 1 fail (each finding on its own line)."""
import glob
import os
import re
import subprocess
import sys

# Markdown link or image: [text](target) / ![alt](target); the target ends at a space or ")".
MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A path into docs/ named in running text, code or comments: docs/perf/README.md, docs/sim.md.
DOCS_PATH = re.compile(r"(?<![\w./-])docs/[\w./-]*\.(?:md|json|txt|png)\b")
# A source path in a doc page: sched/balance.c, service/mover/mover_cuda*.c.
SRC_PATH = re.compile(r"(?<![\w./-])((?:common|sched|rdma|ipc|cuda|service|tools|tests|python|deploy|"
                      r"scripts|examples)/[\w./*-]*\.(?:c|h|cu|py|sh|ninja|json|md|in|yaml|yml))\b")
# A section named after a path on the same line: docs/cuda.md "Where the slabs live".
SECTION = re.compile(r"(docs/[\w./-]*\.md)\)? \"([^\"\n]{2,80})\"")
# Numbered sections after a docs/ path: docs/algorithms.md §2.1, §5.1 / docs/algorithms.md §3-§4.
NUMBERED = re.compile(r"(docs/[\w./-]*\.md)\)? §(\d+(?:\.\d+)*)((?:(?:, | and |-|–)§?\d+(?:\.\d+)*)*)")
# Citations of what a reader of the tree cannot open.
CITATION = re.compile(r"\bDESIGN\b|\bSTYLE\.md\b|\b[Ii]ssues? #?\d|(?<![\w&/])#\d+\b(?!\.\d)")

SKIP_DIRS = {".git", "node_modules", "__pycache__"}
TEXT_EXT = {".md", ".c", ".h", ".cu", ".py", ".sh", ".ninja", ".in", ".txt", ".json", ".yaml",
            ".yml", ".service", ".toml", ".cfg", ".pc", ""}


def tree_files(src):
    """The tracked files when src is a git checkout, else every file outside build*/ and dot dirs."""
    try:
        out = subprocess.run(["git", "-C", src, "ls-files", "-z"], capture_output=True, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n]
        if names:
            yield from sorted(names)
            return
    except (OSError, subprocess.CalledProcessError):
        pass
    for root, dirs, files in os.walk(src):
        rel_root = os.path.relpath(root, src)
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")
                         and not (rel_root == "." and d.startswith("build")))
        for f in sorted(files):
            yield os.path.normpath(os.path.join(rel_root, f))


def is_text(path):
    ext = os.path.splitext(path)[1]
    if ext not in TEXT_EXT:
        return False
    try:
        with open(path, "rb") as fh:
            return b"\0" not in fh.read(4096)
    except OSError:
        return False


def sections(path, cache={}):
    """Headings and bold paragraph labels ("**Sockets.** ...") of a Markdown file, lower-cased,
    backquotes dropped."""
    if path not in cache:
        names = []
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("#"):
                    names.append(line.lstrip("#").strip().lower().replace("`", ""))
                m = re.match(r"\s*(?:[*-] )?\*\*([^*]+)\*\*", line)
                if m:
                    names.append(m.group(1).strip().lower().replace("`", ""))
        cache[path] = names
    return cache[path]


def numbered(path, cache={}):
    """The numbers of a Markdown file's numbered headings ("## 2. RailBalance", "### 2.5 Weights")."""
    if path not in cache:
        with open(path, encoding="utf-8", errors="replace") as fh:
            cache[path] = {m.group(1) for m in (re.match(r"#+\s+(\d+(?:\.\d+)*)\.?\s", line)
                                                for line in fh) if m}
    return cache[path]


def section_ok(path, name):
    """A heading or label that starts with the name; "A: B" names heading A, then heading B."""
    names = sections(path)
    name = name.replace("`", "")
    parts = [name.lower()] if any(n.startswith(name.lower()) for n in names) else \
        [x.strip().lower() for x in name.split(":")]
    return all(any(n.startswith(x) for n in names) for x in parts)


def check(src):
    bad = []
    for rel in tree_files(src):
        path = os.path.join(src, rel)
        if not is_text(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().split("\n")
        in_fence = False
        is_page = (rel == "README.md" or rel.startswith("docs/")) and rel.endswith(".md") and \
            not rel.startswith("docs/perf/runs/")
        for no, line in enumerate(lines, 1):
            where = "%s:%d" % (rel, no)
            # Raw run outputs keep what a tool printed; only their links matter.
            if rel.endswith(".md"):
                if line.lstrip().startswith("```"):
                    in_fence = not in_fence
                if not in_fence:
                    for target in MD_LINK.findall(line):
                        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                            continue
                        target = target.split("#", 1)[0]
                        dest = os.path.normpath(os.path.join(os.path.dirname(path), target))
                        if not os.path.exists(dest):
                            bad.append("%s: link to %s: no such file" % (where, target))
            for target in DOCS_PATH.findall(line):
                if not os.path.exists(os.path.join(src, target)):
                    bad.append("%s: names %s: no such file" % (where, target))
            if is_page:
                for target in SRC_PATH.findall(line):
                    if not glob.glob(os.path.join(src, target)):
                        bad.append("%s: names %s: no such file" % (where, target))
            for target, first, more in NUMBERED.findall(line):
                full = os.path.join(src, target)
                if os.path.exists(full):
                    for num in [first] + re.findall(r"\d+(?:\.\d+)*", more):
                        if num not in numbered(full):
                            bad.append("%s: %s has no section §%s" % (where, target, num))
            for target, name in SECTION.findall(line):
                full = os.path.join(src, target)
                if os.path.exists(full) and not section_ok(full, name):
                    bad.append("%s: %s has no section %r" % (where, target, name))
            if rel.startswith("tests/docs/") or rel.endswith(".json"):
                continue
            m = CITATION.search(line)
            if m:
                bad.append("%s: cites %r, which is not in the tree" % (where, m.group(0)))
    return bad


def main():
    if len(sys.argv) > 1:
        src = sys.argv[1]
    else:  # copied to $b/test/: the source tree is the build directory's parent
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isdir(os.path.join(src, "docs")):
        print("check_links: no docs/ under %s" % src)
        return 1
    bad = check(src)
    for b in bad:
        print(b)
    print("%d finding(s)" % len(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
