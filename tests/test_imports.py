"""Package structure: every module imports, the intra-package import graph is acyclic, and no module
imports another module's private (leading-underscore) names.

The graph is built from each file's AST: every intra-package import, at module level or inside a function
(a circle hidden behind a function-local import is still a circle). ``from .x import y`` is an edge to
``x.y`` when that is a module, else to ``x``; a package's ``__init__`` is a node of its own. The
subpackages (comm, topology, attention, sp, megatron, deepspeed; the root ``__init__`` facade aside) are
layered as well: no two of them import each other, directly or around a longer loop.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import megatron_sp_ext

PKG = "megatron_sp_ext"
ROOT = Path(megatron_sp_ext.__file__).parent
# adapters whose framework may be missing (installed in CI): skipped only when it does not import
# (longest prefix first); lm_spec builds a layer spec from Megatron-LM's global args when imported
OPTIONAL = {f"{PKG}.megatron.lm_spec": "megatron.training", f"{PKG}.megatron": "megatron.core",
            f"{PKG}.deepspeed": "deepspeed"}


def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file (packages by their __init__.py)."""
    mods = {PKG: ROOT / "__init__.py"}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        mods[".".join((PKG, *parts))] = path
    return mods


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, level: int, target: "str | None") -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """Intra-package imports of ``name`` anywhere in the file: (imported module, names taken from it, line)."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == PKG]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(name, node.level, node.module)
            if src.split(".")[0] != PKG:
                continue
            plain = []
            for a in node.names:
                sub = f"{src}.{a.name}"
                if sub in MODULES:          # from .pkg import module
                    out.append((sub, [], node.lineno))
                else:
                    plain.append(a.name)
            if plain:
                out.append((src, plain, node.lineno))
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name in MODULES:
        graph[name] = {dst for dst, _, _ in _imports(name) if dst in MODULES and dst != name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> "list[str] | None":
    white, grey, black = 0, 1, 2
    color = {n: white for n in graph}
    path: list[str] = []

    def visit(n: str) -> "list[str] | None":
        color[n] = grey
        path.append(n)
        for m in sorted(graph[n]):
            if color[m] == grey:
                return path[path.index(m):] + [m]
            if color[m] == white:
                found = visit(m)
                if found:
                    return found
        path.pop()
        color[n] = black
        return None

    for n in sorted(graph):
        if color[n] == white:
            found = visit(n)
            if found:
                return found
    return None


def _optional_missing(name: str) -> "str | None":
    for prefix, dep in OPTIONAL.items():
        if name == prefix or name.startswith(prefix + "."):
            try:
                importlib.import_module(dep)
            except ImportError:
                return dep
            return None
    return None


def test_walk_packages_finds_every_file():
    walked = {m.name for m in pkgutil.walk_packages([str(ROOT)], prefix=PKG + ".",
                                                    onerror=lambda name: None)} | {PKG}
    # walk_packages imports packages to list their children: optional adapters' children may be missing
    missing = {n for n in MODULES if n not in walked and _optional_missing(n) is None}
    assert not missing, f"modules pkgutil does not see (a directory without __init__.py?): {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports(name):
    dep = _optional_missing(name)
    if dep is not None:
        pytest.skip(f"{dep} is not installed")
    importlib.import_module(name)


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _subpackage(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_subpackages_are_layered():
    layers: dict[str, set[str]] = {}
    for src, dsts in _graph().items():
        if src == PKG:  # the facade re-exports every layer
            continue
        a = _subpackage(src)
        layers.setdefault(a, set()).update(b for b in map(_subpackage, dsts) if b and b != a)
    for a in list(layers):
        for b in layers[a]:
            layers.setdefault(b, set())
    cycle = _find_cycle(layers)
    assert cycle is None, "subpackages import each other: " + " -> ".join(cycle)


def _private_attributes(name: str) -> list[str]:
    """``mod._x`` where ``mod`` names another module of the package (``from . import mod``)."""
    tree = ast.parse(MODULES[name].read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _resolve(name, node.level, node.module)
            mods |= {a.asname or a.name for a in node.names if f"{src}.{a.name}" in MODULES}
        elif isinstance(node, ast.Import):
            mods |= {a.asname for a in node.names if a.asname and a.name in MODULES}
    return [f"{MODULES[name].relative_to(ROOT.parent)}:{node.lineno}: {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in mods
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def test_no_private_names_across_modules():
    bad = []
    for name in sorted(MODULES):
        for src, names, line in _imports(name):
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{MODULES[name].relative_to(ROOT.parent)}:{line}: from {src} import {n}")
        bad += _private_attributes(name)
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_cycle_finder_reports_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_ulysses_family_plans_provide_the_plan_interface():
    """Every plan the Ulysses engine reads carries AttendPlan's fields (typed, no getattr probes)."""
    import dataclasses

    from megatron_sp_ext.sp.layers.async_qkv import AsyncPlan
    from megatron_sp_ext.sp.layers.allgather import GatherPlan
    from megatron_sp_ext.sp.layers.tp_cp import TpCpPlan
    from megatron_sp_ext.sp.ulysses.packed import PackedPlan
    from megatron_sp_ext.sp.ulysses.plan import AttendPlan, UlyssesPlan
    need = set(AttendPlan.__annotations__)
    for cls in (UlyssesPlan, PackedPlan, AsyncPlan, GatherPlan, TpCpPlan):
        missing = need - {f.name for f in dataclasses.fields(cls)}
        assert not missing, f"{cls.__name__} lacks {sorted(missing)}"
