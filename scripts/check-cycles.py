#!/usr/bin/env python3
"""Fails on a dependency cycle between the source files of a crate (issue 37).

Each file is a module; a file depends on another when it names it through a path: `crate::a`,
`crate::a::b`, `super::a`, `self::a` or a child module's name. Tests (`tests.rs`, `tests/`,
`*_tests.rs`, and anything after `#[cfg(test)]`) are left out: they may look at anything.
Cycles already known are listed in KNOWN with the reason they stay; a new one fails.

It also fails on a `Result<_, String>` outside tests: errors are typed (thiserror), so a
caller can tell by its type what failed. And it keeps spoolctl on the wire: the files of `src/bin/spoolctl/` may name no crate of
the workspace but `spool_api` (the wire types), so the CLI renders only what the daemon
sends and nothing of the storage stack leaks into what it shows.

    python3 scripts/check-cycles.py
"""

import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates")

# Cycles that exist and why (sorted module lists); a cycle not here fails the check.
KNOWN = {}


def roots(crate_src):
    """Each module tree of a crate: its library (src/) and each binary directory (src/bin/X/)."""
    out = [(crate_src, True)]
    bins = os.path.join(crate_src, "bin")
    if os.path.isdir(bins):
        out += [(os.path.join(bins, b), False) for b in sorted(os.listdir(bins))
                if os.path.isdir(os.path.join(bins, b))]
    return out


def modules(src, skip_bin=True):
    """Module path (tuple) -> file, for every .rs file under src (a crate's src/)."""
    out = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            if any(p == "tests" or p.endswith("_tests") or (skip_bin and p == "bin") for p in parts):
                continue
            out[tuple(parts)] = os.path.join(dirpath, f)
    return out


def body(path):
    text = open(path).read()
    cut = text.find("#[cfg(test)]")
    text = text if cut < 0 else text[:cut]
    # Doc comments and comments name modules without depending on them.
    return re.sub(r"//[^\n]*", "", text)


def resolve(mods, base, names):
    """The longest module prefix of `base + names` that is a file."""
    path = tuple(base) + tuple(names)
    for n in range(len(path), 0, -1):
        if path[:n] in mods:
            return path[:n]
    return None


def edges(mods):
    g = {m: set() for m in mods}
    for m, f in mods.items():
        text = body(f)
        # Module of the file itself: a mod.rs / lib.rs is its directory.
        here = list(m)
        for mt in re.finditer(r"\b(crate|super|self)((?:::\w+)+)", text):
            kind, rest = mt.group(1), mt.group(2).split("::")[1:]
            if kind == "crate":
                base = []
            elif kind == "super":
                base = here[:-1]
                while rest and rest[0] == "super":
                    base, rest = base[:-1], rest[1:]
            else:
                base = here
            t = resolve(mods, base, rest)
            # A module using its ancestors is one unit with them (a mod.rs and its files).
            if t is not None and t != m and m[: len(t)] != t:
                g[m].add(t)
    return g


def cycles(g):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, i = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = i[0]
        i[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted("::".join(c) or "lib" for c in comp))

    sys.setrecursionlimit(10000)
    for v in g:
        if v not in index:
            visit(v)
    return out


# Binaries that may name only these crates of the workspace.
WIRE_ONLY = {("spool-control", "spoolctl"): {"spool_api"}}


def foreign_crates(root, allowed):
    """Workspace crates (spool_*) the files under root name beyond `allowed`."""
    found = set()
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".rs"):
                found |= set(re.findall(r"\b(spool_[a-z_]+)::", body(os.path.join(d, f))))
                found |= set(re.findall(r"\buse (spool_[a-z_]+)\b", body(os.path.join(d, f))))
    return sorted(found - allowed)


def string_errors(text):
    """Each `Result<T, String>` in `text`: the generics read with their nesting, so that
    `Result<HashMap<String, String>, E>` is not one."""
    found = []
    for m in re.finditer(r"\bResult<", text):
        depth, args, start = 1, [], m.end()
        for i in range(m.end(), len(text)):
            c = text[i]
            if c in "<([":
                depth += 1
            elif c in ">)]" and not (c == ">" and text[i - 1] == "-"):
                depth -= 1
                if depth == 0:
                    args.append(text[start:i])
                    break
            elif c == "," and depth == 1:
                args.append(text[start:i])
                start = i + 1
            elif c in ";{":
                break
        if len(args) == 2 and args[1].strip() == "String":
            found.append(text[m.start():i + 1])
    return found


def untyped_errors(src):
    """`Result<_, String>` in the non-test files under a crate's src/ (binaries included):
    errors are typed, so a caller can tell by its type what failed (issue 37)."""
    found = []
    for d, _, files in os.walk(src):
        for f in sorted(files):
            path = os.path.join(d, f)
            parts = os.path.relpath(path, src)[:-3].split(os.sep)
            if not f.endswith(".rs") or any(p == "tests" or p.endswith("_tests") for p in parts):
                continue
            found += [f"{os.path.relpath(path, ROOT)}: {e}" for e in string_errors(body(path))]
    return found


def main():
    bad = 0
    for (crate, binary), allowed in WIRE_ONLY.items():
        for c in foreign_crates(os.path.join(ROOT, crate, "src", "bin", binary), allowed):
            print(f"{binary} names {c}: it may use only {', '.join(sorted(allowed))} (the wire types)")
            bad += 1
    for crate in sorted(os.listdir(ROOT)):
        src = os.path.join(ROOT, crate, "src")
        if not os.path.isdir(src):
            continue
        for e in untyped_errors(src):
            print(f"an untyped error in {e}: give it an error type")
            bad += 1
        for root, is_lib in roots(src):
            name = crate if is_lib else f"{crate} bin {os.path.basename(root)}"
            for c in cycles(edges(modules(root, skip_bin=is_lib))):
                key = f"{name}: {' '.join(c)}"
                if key in KNOWN:
                    continue
                print(f"cycle between files of {name}: {', '.join(c)}")
                bad += 1
    if bad:
        print(f"{bad} dependency cycles, layering breaks or untyped errors (scripts/check-cycles.py)")
        sys.exit(1)
    print("file dependencies: no cycles (beyond the ones listed with a reason); spoolctl uses only the wire types; errors are typed")


if __name__ == "__main__":
    main()
