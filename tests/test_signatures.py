"""The project's parameter rule (#85): no function or method of the library takes more than 12 parameters.

Counted from the source (AST), so a function that is never imported is counted too: positional-only, positional,
keyword-only, ``*args`` and ``**kwargs`` each count one; ``self`` / ``cls`` of a method do not. Lambdas count
like functions. A function over the limit groups its settings into a dataclass (the layers' ``LayerWeights`` /
``LayerRun``, ``AttentionProblem``) or takes them through a keyword adapter.
"""
from __future__ import annotations

import ast
from pathlib import Path

import megatron_sp_ext

LIMIT = 12
PACKAGE = Path(megatron_sp_ext.__file__).resolve().parent


def parameter_count(args: ast.arguments) -> int:
    """Parameters of a def or lambda: positional-only + positional + keyword-only + *args + **kwargs, minus a
    leading ``self`` / ``cls``."""
    names = [a.arg for a in args.posonlyargs + args.args]
    n = len(names) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)
    return n - 1 if names and names[0] in ("self", "cls") else n


def offenders(root: Path, limit: int = LIMIT) -> list[str]:
    """``path:line name (count)`` of every def / lambda under ``root`` with more than ``limit`` parameters."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                n = parameter_count(node.args)
                if n > limit:
                    name = getattr(node, "name", "<lambda>")
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {name} ({n} parameters)")
    return out


def test_parameter_count_is_counted_as_the_rule_says():
    src = ("def f(a, /, b, *c, d, **e): pass\n"
           "class K:\n    def m(self, a, b): pass\n    @classmethod\n    def n(cls, a): pass\n"
           "g = lambda x, y=1: x\n")
    counts = {getattr(n, "name", "<lambda>"): parameter_count(n.args) for n in ast.walk(ast.parse(src))
              if isinstance(n, (ast.FunctionDef, ast.Lambda))}
    assert counts == {"f": 5, "m": 2, "n": 1, "<lambda>": 2}


def test_offenders_are_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("def ok(" + ", ".join(f"a{i}" for i in range(12)) + "): pass\n\n"
                              "def wide(" + ", ".join(f"a{i}" for i in range(12)) + ", *, z): pass\n")
    assert offenders(pkg) == ["pkg/m.py:3 wide (13 parameters)"]


def test_no_library_function_takes_more_than_12_parameters():
    bad = offenders(PACKAGE)
    assert not bad, (f"{len(bad)} function(s) of megatron_sp_ext take more than {LIMIT} parameters (positional + "
                     f"keyword-only + *args + **kwargs, self/cls not counted); group their settings into a "
                     f"dataclass (see the layers' LayerWeights / LayerRun, sp/problem.py's AttentionProblem):\n  "
                     + "\n  ".join(bad))
