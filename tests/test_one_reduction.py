"""#85: one differentiable all-reduce in the library (comm/autograd_reduce.all_reduce_sum): no other autograd Function
calls all_reduce (the all-gather layer had its own copy of the same sum and its backward)."""
import ast
import pathlib

from tests.source_scan import ROOT, offenders

HOME = "megatron_sp_ext/comm/autograd_reduce.py"


def _reducing_functions(path: pathlib.Path) -> list:
    """(line, class) of every torch.autograd.Function subclass in ``path`` whose body calls ``all_reduce``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("autograd.Function") for b in node.bases):
            calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                     and c.func.attr == "all_reduce"]
            if calls:
                found.append((node.lineno, node.name))
    return found


def test_one_autograd_all_reduce():
    found = offenders(("megatron_sp_ext", "training"), _reducing_functions,
                      skip=lambda p: p.relative_to(ROOT).as_posix() == HOME)
    assert not found, f"autograd Functions summing over ranks beside comm/autograd_reduce.py: {found}"
    assert _reducing_functions(ROOT / HOME), "the scan must see the one it allows"
