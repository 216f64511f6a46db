"""CUDA suite workers for issue #35 items 2 and 3 (records as in tests/gpu/cuda_suite.py).

- ``auto_family``: the factory's ``auto`` (sp.factory.SPAttention with the ModePolicy of sp.calibration) with each
  branch forced through the real calibration by an injected timer (hcms, ring, and tasp beyond 2 ranks), and once
  with the default CUDA-event timer (whatever it picks, named in the case), against float64: causal zigzag sbhd
  (Megatron) and non-causal bshd with key padding (DeepSpeed / DiT), GQA, bf16.
- ``exchange_copies_family``: the Ulysses exchanges that carry the placement's permutation per piece (B == 1,
  causal zigzag; sp.ulysses.engine) against the pre-change path (per-piece exchanges off) bitwise (tol 0), and the
  one-pass pack of q|k|v given as views of one fused [S, B, H, 3 * D] tensor against separate tensors bitwise,
  C = 1 and 2, both against float64 too.
Dry run on the CPU: SPX_SUITE_DEVICE=cpu SPX_SUITE_SHRINK=16 (tests/test_adapter_copies.py runs it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.calibration import ModePolicy, time_ms, wall_time_ms
from megatron_sp_ext.sp.factory import SPResources, make_attention
from megatron_sp_ext.sp.ulysses import engine
from tests.gpu.cuda_suite import BF16, DEV, SHRINK, _one, _valid, use_ring_route
from tests.reference import make_qkv, rel_err


def _forcing(pick):
    def timer(fn, iters, warmup, group):
        fn()
        return 1.0 if fn.mode == pick else 2.0
    return timer


def auto_family(rank: int, world: int) -> list:
    use_ring_route()
    g, rec, n = dist.group.WORLD, [], 0
    s, d = 2048, 64
    picks = ["hcms", "ring"] + (["tasp"] if world > 2 else []) + ["measured"]
    for h, hkv in ((8, 8), (8, 4)):
        for layout, placement, causal, pad in (("sbhd", "zigzag", True, 0), ("bshd", "contiguous", False, 40)):
            for pick in picks:
                cfg = SPConfig(mode="auto", head_chunks=2 if h // world >= 2 else 1)
                timed = {"timed_devices": (DEV,), "rounds": 3, "warmup": 1}
                timer = _forcing(pick) if pick != "measured" else time_ms if DEV == "cuda" else wall_time_ms
                policy = ModePolicy(timer=timer, **timed)
                res = SPResources(cfg, mode_policy=policy)
                res.speed_plan = None   # every branch through the calibration (the emulated route spans "machines")
                attn = make_attention(cfg, g, num_heads=h, num_kv_heads=hkv, layout=layout, placement=placement,
                                      resources=res)

                def fn(q, k, v, attn=attn, causal=causal, pad=pad):
                    bshd = q if layout == "bshd" else q.transpose(0, 1)
                    return attn(q, k, v, causal=causal, kv_valid_len=_valid(bshd, world, pad) if pad else None)
                _one(rec, "auto", f"pick={pick}", fn, rank, world, dtype=BF16, causal=causal, placement=placement,
                     layout=layout, s=s, h=h, hkv=hkv, d=d, seed=n, pad=pad)
                if pick == "measured":  # name what the calibration picked (the same on every rank)
                    rec[-1]["case"] += f" -> {next(iter(policy.cache.values())).chunks}"
                n += 1
    user_auto_on_the_plain_group(rec, rank, world, g, s, d, n)
    return rec


def user_auto_on_the_plain_group(rec: list, rank: int, world: int, g, s: int, d: int, n: int) -> None:
    """As a user calls it: ``make_attention(SPConfig(mode="auto"))`` with default resources on the group as it is
    (no emulated machines: on gloo with CUDA tensors its point-to-point hops cannot run), against float64; and
    ``mode="ring"`` there refused by name before any exchange (the group stays usable for the next case)."""
    import os  # noqa: PLC0415
    saved = os.environ.pop("SPX_EMULATED_MACHINE_SIZE", None)
    try:
        attn = make_attention(SPConfig(mode="auto"), g, num_heads=8, placement="zigzag")
        _one(rec, "auto", "user make_attention(SPConfig(mode='auto')), plain group",
             lambda q, k, v: attn(q, k, v, causal=True), rank, world, dtype=BF16, causal=True, placement="zigzag",
             s=s, h=8, hkv=8, d=d, seed=n)
        ring = make_attention(SPConfig(mode="ring"), g, num_heads=8)
        q = torch.randn(1, s // SHRINK // world, 8, d, device=DEV, dtype=BF16)
        gloo_cuda = dist.get_backend(g) == "gloo" and DEV == "cuda"
        try:
            ring(q, q, q, causal=False)
            refused = False
        except SPConfigError as e:
            refused = "cannot run on this process group with CUDA tensors" in str(e)
        rec.append({"family": "auto", "case": f"P={world} mode='ring' on {dist.get_backend(g)} with {DEV} tensors "
                    f"{'refused by name' if gloo_cuda else 'runs'}", "errs": {"check": 0.0 if refused == gloo_cuda
                                                                                     else 1.0}, "tol": 0.5})
    finally:
        if saved is not None:
            os.environ["SPX_EMULATED_MACHINE_SIZE"] = saved


def exchange_copies_family(rank: int, world: int) -> list:
    g, rec, n = dist.group.WORLD, [], 0
    s, h, d = 4096, 8, 64
    for c in (1, 2):
        kw = dict(head_chunks=c, causal=True, layout="sbhd", placement="zigzag")
        # against float64, through the per-piece path (B == 1, zigzag)
        _one(rec, "exchange_copies", f"C={c} per-piece", lambda q, k, v: spx.ulysses_attention(q, k, v, g, **kw),
             rank, world, dtype=BF16, causal=True, placement="zigzag", layout="sbhd", s=s, h=h, hkv=h, d=d, seed=n)
        _one(rec, "exchange_copies", f"C={c} fused q|k|v views",
             lambda q, k, v: spx.ulysses_attention(*torch.split(torch.cat([q, k, v], dim=3), [d, d, d], dim=3), g,
                                                   **kw),
             rank, world, dtype=BF16, causal=True, placement="zigzag", layout="sbhd", s=s, h=h, hkv=h, d=d, seed=n)
        # bitwise: now vs the pre-change path, separate vs fused views
        sl = s // SHRINK // world
        q, k, v, do = (t[:, :sl].transpose(0, 1).contiguous().to(DEV) for t in make_qkv(100 + n + rank, 1, sl, h, h, d,
                                                                                            BF16))

        def run(fused: bool, pieces_on: bool):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            args = torch.split(torch.cat(leaves, dim=3), [d, d, d], dim=3) if fused else leaves
            slots = engine.MAX_PIECE_SLOTS
            engine.MAX_PIECE_SLOTS = slots if pieces_on else 0
            try:
                out = spx.ulysses_attention(*args, g, **kw)
                out.backward(do)
            finally:
                engine.MAX_PIECE_SLOTS = slots
            return [out.detach()] + [t.grad for t in leaves]
        before = run(False, False)
        for name, fused, pieces_on in (("per-piece vs before", False, True), ("fused views vs before", True, False),
                                       ("fused per-piece vs before", True, True)):
            got = run(fused, pieces_on)
            errs = {k_: rel_err(a, b) for k_, a, b in zip(("out", "dq", "dk", "dv"), got, before)}
            errs.update({f"{k_}_bitwise": float(not torch.equal(a, b))
                         for k_, a, b in zip(("out", "dq", "dk", "dv"), got, before)})
            rec.append({"family": "exchange_copies", "case": f"P={world} C={c} {name} {BF16} s={sl * world} h={h} "
                                                             f"d={d} sbhd zigzag causal", "errs": errs, "tol": 0.0})
        n += 1
    return rec
