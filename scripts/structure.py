"""Issue 46's structure figures: import cycles and levels of a package, and the walk of ``temperature``.

* Imports: for each module of the package, the intra-package modules it
  imports (``import`` / ``from ... import`` anywhere in the module body but
  inside functions, ``if TYPE_CHECKING`` blocks skipped; importing ``a.b``
  counts package ``a`` too); ``--all`` adds the imports inside functions (the
  deferred ones, which close cycles at call time). Cycles: the strongly
  connected groups of that graph. Levels: the longest import chain, in
  modules, the package's ``__init__`` included.
* Walk (``--walk ENGINE``, torch only): the chain of dualvp's functions from
  ``dualvp_torch.logprob_entropy(..., temperature=0.7)`` to the first
  ``dualvp/spec.py`` function that takes a ``temperature`` (a second call,
  caches warm), and how often it returns to a module it already left.

Usage: python scripts/structure.py [--package dualvp_torch] [--all] [--walk eager] [-v]
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from functools import lru_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules(pkg: str) -> dict:
    out = {}
    for dp, _, files in os.walk(os.path.join(ROOT, pkg)):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dp, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dp, f)
    return out


def imports(mods: dict, m: str, pkg: str, deferred: bool) -> set:
    here = m.split(".") if mods[m].endswith("__init__.py") else m.split(".")[:-1]
    found = set()

    def visit(nodes):
        for n in nodes:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and not deferred:
                continue
            if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING":
                continue
            if isinstance(n, ast.Import):
                found.update(a.name for a in n.names if a.name.split(".")[0] == pkg)
            elif isinstance(n, ast.ImportFrom):
                base = ".".join(here[: len(here) - n.level + 1] + ([n.module] if n.module else [])) if n.level \
                    else (n.module or "")
                if base.split(".")[0] == pkg:
                    found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in n.names)
            for child in ast.iter_child_nodes(n):
                visit([child])

    visit(ast.parse(open(mods[m]).read()).body)
    deps = set()
    for t in found:
        while t not in mods and "." in t:
            t = t.rsplit(".", 1)[0]
        while t:
            if t in mods and t != m and not m.startswith(t + "."):
                deps.add(t)
            t = t.rsplit(".", 1)[0] if "." in t else ""
    return deps


def cycles(graph: dict) -> list:
    index, low, stack, on, groups = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            strong(v)
    return groups


def walk(engine: str) -> list:
    sys.path.insert(0, ROOT)
    import torch

    import dualvp_torch

    z = torch.randn(8, 64, requires_grad=True)
    y = torch.randint(0, 64, (8,))
    dualvp_torch.logprob_entropy(z * 1, y, temperature=0.7, impl=engine)
    roots = tuple(os.path.join(ROOT, p) + os.sep for p in ("dualvp", "dualvp_torch", "dualvp_jax"))
    spec_file = os.path.join(ROOT, "dualvp", "spec.py")
    chains = []

    def prof(frame, event, arg):
        code = frame.f_code
        if event == "call" and not chains and os.path.abspath(code.co_filename) == spec_file \
                and "temperature" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
            chain, f = [], frame
            while f is not None:
                fn = os.path.abspath(f.f_code.co_filename)
                if fn.startswith(roots):
                    chain.append((os.path.relpath(fn, ROOT), f.f_code.co_name))
                f = f.f_back
            chains.append(chain[::-1])

    sys.setprofile(prof)
    try:
        dualvp_torch.logprob_entropy(z * 1, y, temperature=0.7, impl=engine)
    finally:
        sys.setprofile(None)
    return chains[0] if chains else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--package", default="dualvp_torch")
    ap.add_argument("--all", action="store_true", help="count the imports inside functions too")
    ap.add_argument("--walk", metavar="ENGINE", help="the walk of temperature on this engine")
    ap.add_argument("-v", action="store_true", help="every module's level and imports")
    a = ap.parse_args(argv)
    mods = modules(a.package)
    graph = {m: imports(mods, m, a.package, a.all) for m in mods}

    @lru_cache(None)
    def chain(m, seen=()):
        return (m,) + max((chain(d, seen + (m,)) for d in graph[m] if d not in seen), key=len, default=())

    longest = max((chain(m) for m in graph), key=len)
    print(f"{a.package}: {len(mods)} modules, {sum(map(len, graph.values()))} import edges"
          f"{' (deferred imports included)' if a.all else ''}")
    print(f"cycles: {len(cycles(graph))} {cycles(graph)}")
    print(f"levels: {len(longest)}: {' -> '.join(longest)}")
    if a.v:
        for m in sorted(graph):
            print(f"  {len(chain(m)):2d} {m}: {', '.join(sorted(graph[m]))}")
    if a.walk:
        steps, back, passed = walk(a.walk), 0, []
        for i, (f, name) in enumerate(steps, 1):
            again = bool(passed) and passed[-1] != f and f in passed
            back += again
            if not passed or passed[-1] != f:
                passed.append(f)
            print(f"  {i:2d} {f}:{name}{'  (back in a module already passed)' if again else ''}")
        print(f"temperature, impl={a.walk}: {len(steps)} functions to the spec, {back} returns to a module passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
