#!/usr/bin/env python3
"""Size budget for the source tree (issue 16): no source file over 600 lines and no
function over 80 lines outside tests. Test modules (`#[cfg(test)]` blocks, `tests.rs`,
`*_tests.rs`, `tests/`, `benches/`, `fuzz/`) are not counted. Exceptions are listed in
ALLOWED with the reason; the script fails when a new offender appears.

Usage: scripts/check-size.py [--all]   (--all prints every function over the limit)
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FILE_LIMIT = 600
FN_LIMIT = 80
# path -> reason; function "path::name" -> reason
ALLOWED = {
}

FN_RE = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+\"C\"\s+)?fn\s+([A-Za-z_0-9]+)")


def strip(line, state):
    """Removes string, char and comment text so brace counting sees code only."""
    out = []
    i = 0
    n = len(line)
    while i < n:
        if state["block"]:
            j = line.find("*/", i)
            if j < 0:
                return "".join(out)
            state["block"] = False
            i = j + 2
            continue
        c = line[i]
        if state["str"]:
            if c == "\\":
                i += 2
                continue
            if c == '"':
                state["str"] = False
            i += 1
            continue
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            state["block"] = True
            i += 2
            continue
        if c == '"':
            state["str"] = True
            i += 1
            continue
        if c == "'":
            m = re.match(r"'(\\.|[^\\'])'", line[i:])
            if m:
                i += len(m.group(0))
                continue
        out.append(c)
        i += 1
    return "".join(out)


def code_lines(path):
    """Yields (lineno, raw, code) for lines outside #[cfg(test)] items."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    state = {"block": False, "str": False}
    skip_depth = None
    depth = 0
    pending_test = False
    for no, raw in enumerate(lines, 1):
        code = strip(raw, state)
        if skip_depth is None and re.match(r"\s*#\[cfg\(test\)\]", raw):
            pending_test = True
            continue
        opens = code.count("{")
        closes = code.count("}")
        if pending_test and skip_depth is None:
            if opens:
                skip_depth = depth
                depth += opens - closes
                pending_test = False
                if depth <= skip_depth:
                    skip_depth = None
                continue
            if code.strip().endswith(";"):
                pending_test = False
                continue
            continue
        depth += opens - closes
        if skip_depth is not None:
            if depth <= skip_depth:
                skip_depth = None
            continue
        yield no, raw, code


def functions(path):
    items = list(code_lines(path))
    out = []
    for idx, (no, raw, code) in enumerate(items):
        m = FN_RE.match(code)
        if not m:
            continue
        depth = 0
        started = False
        for no2, raw2, code2 in items[idx:]:
            if not started and code2.rstrip().endswith(";") and "{" not in code2:
                break  # declaration without a body
            depth += code2.count("{") - code2.count("}")
            if code2.count("{"):
                started = True
            if started and depth <= 0:
                out.append((m.group(7), no, no2 - no + 1))
                break
    return out


def is_test_path(rel):
    parts = rel.split(os.sep)
    base = parts[-1]
    return ("tests" in parts or "benches" in parts or "fuzz" in parts
            or base == "tests.rs" or base.endswith("_tests.rs"))


def main():
    show_all = "--all" in sys.argv
    bad = []
    for top in ["crates"]:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if not name.endswith(".rs"):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, ROOT)
                if is_test_path(rel):
                    continue
                n = sum(1 for _ in code_lines(path))
                if n > FILE_LIMIT and rel not in ALLOWED:
                    bad.append(f"{rel}: {n} lines outside tests (limit {FILE_LIMIT})")
                for fname, line, length in functions(path):
                    key = f"{rel}::{fname}"
                    if length > FN_LIMIT and key not in ALLOWED:
                        bad.append(f"{rel}:{line}: fn {fname} is {length} lines (limit {FN_LIMIT})")
    for b in bad:
        print(b)
    if bad:
        print(f"{len(bad)} over the size budget (scripts/check-size.py)")
        return 1
    print("size budget: every file and function within limits (or listed with a reason)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
