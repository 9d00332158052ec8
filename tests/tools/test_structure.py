"""Issue 46's import-structure goals, measured by ``scripts/structure.py`` on the source (no import runs).

No import cycle in the three packages, deferred imports (inside functions) included; at most 6 import
levels in ``dualvp_torch`` (module-level imports, the package ``__init__`` counted); no private name
imported across modules, except from a module whose job is to share them.
"""

import ast
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("dualvp", "dualvp_torch", "dualvp_jax")
#: modules whose job is to share helpers with their siblings (their names are imported as modules)
SHARING = {"dualvp.tools._proc", "dualvp_torch.compat._core"}


def _structure():
    spec = importlib.util.spec_from_file_location("structure_script", os.path.join(ROOT, "scripts", "structure.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _graph(s, pkg: str, deferred: bool) -> dict:
    mods = s.modules(pkg)
    return {m: s.imports(mods, m, pkg, deferred) for m in mods}


def _levels(graph: dict) -> int:
    memo: dict = {}

    def depth(m, seen=()):
        if m not in memo:
            memo[m] = 1 + max((depth(d, seen + (m,)) for d in graph[m] if d not in seen), default=0)
        return memo[m]

    return max(depth(m) for m in graph)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_import_cycle_deferred_imports_included(pkg):
    s = _structure()
    assert s.cycles(_graph(s, pkg, deferred=True)) == []
    assert s.cycles(_graph(s, pkg, deferred=False)) == []


def test_torch_import_levels():
    assert _levels(_graph(_structure(), "dualvp_torch", deferred=False)) <= 6


def test_the_measure_sees_a_cycle_and_the_levels():
    # the script's graph functions on a made-up graph: a cycle is found, a chain is counted in modules
    s = _structure()
    assert s.cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _levels({"a": {"b"}, "b": {"c"}, "c": set()}) == 3


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_private_name_imported_across_modules(pkg):
    found = []
    for dp, _, files in os.walk(os.path.join(ROOT, pkg)):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dp, f)
            # (a package's __init__ counts as a module inside it: its relative imports start from the package)
            here = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").split(".")
            for n in ast.walk(ast.parse(open(path).read())):
                if not isinstance(n, ast.ImportFrom):
                    continue
                base = ".".join(here[: len(here) - n.level] + ([n.module] if n.module else [])) if n.level \
                    else (n.module or "")
                if base.split(".")[0] not in PACKAGES:
                    continue
                for a in n.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and f"{base}.{a.name}" not in SHARING:
                        found.append(f"{path}:{n.lineno}: from {base} import {a.name}")
    assert found == []
