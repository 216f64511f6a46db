"""The kernel registry (megatron_sp_ext/attention/kernels/): every list of kernel names derives from it, every kernel
declares what it can do and says why it cannot run a call, and no kernel name is compared anywhere outside it."""
import ast
import pathlib

import torch

from megatron_sp_ext.attention import backends, block_sparse, kernels, lse_kernels, varlen
from megatron_sp_ext.attention.kernels import KernelCall
from megatron_sp_ext.config import BACKENDS

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = set(kernels.ORDER) | set(kernels.settings()) | set(kernels.varlen_methods())


def _compared_names(path: pathlib.Path) -> list:
    """(line, name) of every comparison (==, !=, in, not in) of a kernel name literal in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare) or not any(
                isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            continue
        sides = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, sides, sides[1:]):
            if isinstance(op, (ast.Eq, ast.NotEq)):       # x == "fa4", "fa4" != x
                consts = [left, right]
            elif isinstance(op, (ast.In, ast.NotIn)):     # x in ("fa4", ...): a container of names on the right
                consts = right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else []
            else:
                continue
            found += [(node.lineno, c.value) for c in consts if isinstance(c, ast.Constant) and c.value in NAMES]
    return found


def test_no_kernel_name_is_compared_outside_the_registry():
    files = [p for d in ("megatron_sp_ext", "training", "tools") for p in (ROOT / d).rglob("*.py")
             if "attention/kernels" not in p.as_posix() and "tools/results" not in p.as_posix()]
    assert len(files) > 50
    offenders = {str(p.relative_to(ROOT)): hits for p in files if (hits := _compared_names(p))}
    assert not offenders, f"kernel names compared outside attention/kernels/: {offenders}"


def test_the_scan_finds_a_comparison(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(k):\n    return k == 'fa4' or k in ('cudnn', 'x') or 'flash' in k\n\nfor n in ('fa4',):\n"
                   "    pass\n")
    assert _compared_names(bad) == [(2, "fa4"), (2, "cudnn")]


def test_every_list_of_names_derives_from_the_registry():
    assert set(BACKENDS) == {"auto", "sdpa"} | {kernels.get(n).setting for n in kernels.ORDER
                                                if kernels.get(n).caps.lse and kernels.get(n).caps.dense
                                                or kernels.get(n).caps.tiles == "none"}
    assert lse_kernels.KERNELS == kernels.names("lse", auto_only=True)
    assert set(varlen.KERNEL_METHODS) == {kernels.get(n).caps.varlen for n in kernels.names("varlen")}
    assert block_sparse.KERNELS == ("auto",) + tuple(kernels.get(n).setting for n in kernels.names("tiles",
                                                                                                     auto_only=True))
    assert backends.backend_names() == BACKENDS


def test_every_kernel_declares_and_explains():
    cpu = torch.device("cpu")
    for n in kernels.ORDER:
        k = kernels.get(n)
        assert k.name == n and k.label and k.setting
        for needs in (("plain",), ("lse",), ("varlen",), ("tiles",), ("dropout",)):
            reason = k.why_not(KernelCall(cpu, torch.bfloat16, 64, frozenset(needs)))
            assert reason is None or isinstance(reason, str) and len(reason) > 10, (n, needs, reason)
    assert kernels.get("math").why_not(KernelCall(cpu, torch.float64, 64, frozenset({"lse", "tiles"}))) is None
    assert "block sparsity" in kernels.get("cudnn").why_not(KernelCall(cpu, torch.bfloat16, 64, frozenset({"tiles"})))


def test_auto_picks_the_first_kernel_that_runs_the_call():
    cpu = torch.device("cpu")
    assert kernels.pick(KernelCall(cpu, torch.float32, 64, frozenset({"lse"}))).name == kernels.names("lse")[2]
    assert kernels.pick(KernelCall(cpu, torch.float64, 64, frozenset({"lse"}))).name == kernels.FALLBACK
    assert kernels.pick(KernelCall(cpu, torch.bfloat16, 64, frozenset({"tiles", "lse"}))).name == kernels.FALLBACK
