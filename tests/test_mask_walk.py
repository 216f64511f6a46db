"""#85's walk of the block mask, at run time: from the caller's ``AttentionProblem`` to the local kernel, forward and
backward, in every family (Ulysses, HCMS, the ring; USP's mesh at P=4), on gloo ranks.

A profile hook follows the mask as data: the mask tensor and the problem holding it are marked; every library call
that receives a marked object as a named parameter (directly, or as a field of a dataclass or an element of a tuple
or list) is a step of the walk, and the tensors and dataclasses that call returns are marked in turn (the device
tile tables, the ring's plan and skip tables, a kernel's ``TileSlice``; an over-approximation: q, k, v can be marked
too once they pass such calls). The walk must reach a kernel's ``forward`` / ``attention`` and its ``backward`` with
the mask's tiles in their ``tiles`` parameter, and no step may receive the mask only inside ``**kwargs`` (the dict
splat #85 removed: a reader, or a static tool such as farm-studio's walk, cannot follow it through one). Numbers,
strings and None are never marked (they are shared objects)."""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.sp.factory import make_attention
from tests.harness import run_ranks

PKG = spx.__file__.rsplit("/", 1)[0] + "/"
CO_VARARGS, CO_VARKEYWORDS = 0x04, 0x08


def _markable(x) -> bool:
    """Data that can carry the mask: tensors and dataclass instances (the problem, tile tables, plans); not the
    library's service objects (a backend returned by a call that saw the mask does not hold it)."""
    return isinstance(x, torch.Tensor) or (dataclasses.is_dataclass(x) and not isinstance(x, type))


def carries(x, marked: set, depth: int = 0) -> bool:
    """Whether ``x`` is a marked object, or holds one as a dataclass field / tuple or list element (2 levels)."""
    if id(x) in marked and _markable(x):
        return True
    if depth >= 2:
        return False
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return any(carries(getattr(x, f.name), marked, depth + 1) for f in dataclasses.fields(x))
    if isinstance(x, (tuple, list)):
        return any(carries(e, marked, depth + 1) for e in x[:16])
    return False


class MaskWalk:
    """The profile hook: ``steps`` [(module path, qualified name, named parameters carrying the mask, **kwargs keys
    carrying it)] in call order."""

    def __init__(self, *seeds) -> None:
        self.marked = {id(s) for s in seeds}
        self.keep = list(seeds)   # alive while walking: ids stay unique
        self.steps: list[tuple] = []
        self.open: set = set()

    def __call__(self, frame, event, arg) -> None:
        co = frame.f_code
        if event == "call" and co.co_filename.startswith(PKG):
            n = co.co_argcount + co.co_kwonlyargcount
            loc = frame.f_locals
            named = tuple(a for a in co.co_varnames[:n] if a in loc and carries(loc[a], self.marked))
            splat = ()
            if co.co_flags & CO_VARKEYWORDS:
                kw = loc.get(co.co_varnames[n + bool(co.co_flags & CO_VARARGS)]) or {}
                splat = tuple(k for k, x in kw.items() if carries(x, self.marked))
            if named or splat:
                self.steps.append((co.co_filename[len(PKG):], co.co_qualname, named, splat))
                self.open.add(id(frame))
        elif event == "return" and id(frame) in self.open:
            self.open.discard(id(frame))
            for x in (arg if isinstance(arg, (tuple, list)) else (arg,)):
                if _markable(x):
                    self.marked.add(id(x))
                    self.keep.append(x)


def _walk(rank: int, world: int, mode: str, causal: bool) -> dict:
    torch.manual_seed(0)
    s, tile, heads = 16 * world, 4, 4
    attn = make_attention(SPConfig(mode=mode), dist.group.WORLD, num_heads=heads)
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(heads, s // tile, s // tile, generator=g) < 0.5
    mask[:, :, 0] = True
    problem = attn.problem(causal=causal, block_mask=mask, tile=tile)
    q, k, v = (torch.randn(1, s // world, heads, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    walks = {}
    for phase in ("forward", "backward"):
        walk = MaskWalk(mask, problem) if phase == "forward" else MaskWalk(mask, problem, *walks["forward"].keep)
        sys.setprofile(walk)
        try:
            if phase == "forward":
                out = attn(q, k, v, problem)
            else:
                out.sum().backward()
        finally:
            sys.setprofile(None)
        walks[phase] = walk
    return {p: w.steps for p, w in walks.items()}


def _kernel_steps(steps: list, methods: tuple) -> list:
    return [st for st in steps if st[0].startswith("attention/kernels/") and st[1].rsplit(".", 1)[-1] in methods
            and "tiles" in st[2]]


@pytest.mark.parametrize("mode,world", [("ulysses", 2), ("hcms", 2), ("ring", 2), ("usp", 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_walks_from_the_problem_to_the_kernel(mode, world, causal):
    for rank, steps in enumerate(run_ranks(_walk, world, mode, causal, timeout=240)):
        fwd, bwd = steps["forward"], steps["backward"]
        assert fwd[0][1] == "SPAttention.__call__" and fwd[0][2] == ("problem",), (rank, fwd[:3])
        assert _kernel_steps(fwd, ("forward", "attention")), (mode, rank, "no kernel forward got the tiles", fwd[-12:])
        assert _kernel_steps(bwd, ("backward",)), (mode, rank, "no kernel backward got the tiles", bwd[-12:])
        splats = [st for st in fwd + bwd if st[3]]
        assert not splats, (mode, rank, "the mask passed inside **kwargs", splats)


def test_the_walk_sees_a_splat():
    """The hook can fail: a library-shaped call that passes the mask in ``**kwargs`` is reported as such."""
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    code = compile("def relay(**kw):\n    return kw\n", PKG + "sp/_walk_probe.py", "exec")
    space: dict = {}
    exec(code, space)   # a function whose code lives (by name) in the package: the hook's scope
    walk = MaskWalk(mask)
    sys.setprofile(walk)
    try:
        space["relay"](block_mask=mask)
    finally:
        sys.setprofile(None)
    assert walk.steps == [("sp/_walk_probe.py", "relay", (), ("block_mask",))]
