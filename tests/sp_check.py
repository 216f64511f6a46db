"""Shared per-rank checker: run a sequence-parallel attention on shards and compare with float64.

``check_case`` builds full q/k/v/grad-out from a seed (same on every rank), computes the float64
reference output and input gradients on the full sequence, shards everything with ``shard``,
runs ``attn`` on this rank's shard, back-propagates the sharded grad-out, and asserts the output
and the q/k/v gradients of this rank's shard against the reference shard.
"""
from __future__ import annotations

import torch

from tests.reference import assert_close, make_qkv, reference_attention, rel_err


def contiguous_shard(x_bshd, rank, world):
    s = x_bshd.shape[1] // world
    return x_bshd[:, rank * s:(rank + 1) * s]


def to_layout(x_bshd, layout):
    return x_bshd if layout == "bshd" else x_bshd.transpose(0, 1).contiguous()


def from_layout(x, layout):
    return x if layout == "bshd" else x.transpose(0, 1)


def run_case(attn, rank, world, *, b, s, h, hkv, d, dtype, causal, layout="bshd", seed=0,
             shard=contiguous_shard, mask=None, device="cpu", compare_rows=None, errors=None, segments=None):
    """Returns (out, dq, dk, dv) of this rank (bshd) and asserts them against the reference.
    ``errors`` (a dict): instead of asserting, store each relative error there by name ("out", "dq", ...).
    ``segments`` (cumulative lengths, instead of ``mask``): a block-diagonal reference computed one block at a time
    (the same math as the block mask, in sum(n_i^2) memory instead of S^2)."""
    q, k, v, do = (t.to(device) for t in make_qkv(seed, b, s, h, hkv, d, dtype))
    if compare_rows is not None:  # rows >= compare_rows are padding: no loss flows from them
        do[:, compare_rows:] = 0
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    if segments is not None:
        ref = torch.cat([reference_attention(qr[:, a:b], kr[:, a:b], vr[:, a:b], causal=causal)
                         for a, b in zip(segments, segments[1:]) if b > a], dim=1)
    else:
        ref = reference_attention(qr, kr, vr, causal=causal, mask=mask.to(device) if mask is not None else None)
    ref.backward(do.double())
    shards = [to_layout(shard(t, rank, world), layout).clone().requires_grad_() for t in (q, k, v)]
    out = attn(*shards)
    out.backward(to_layout(shard(do, rank, world), layout))
    got = [from_layout(t, layout) for t in (out, shards[0].grad, shards[1].grad, shards[2].grad)]
    ref_out = ref.detach()
    if compare_rows is not None:  # padded query rows' outputs are don't-care
        pos = shard(torch.arange(s, device=device).view(1, s, 1, 1).expand(b, s, 1, 1), rank, world)
        keep = pos < compare_rows
        got[0] = torch.where(keep, got[0], torch.zeros_like(got[0]))
        ref_out = ref_out * torch.ones_like(ref_out).masked_fill(torch.arange(s, device=device).view(1, s, 1, 1)
                                                                  >= compare_rows, 0)
    want = [shard(t, rank, world) for t in (ref_out, qr.grad, kr.grad, vr.grad)]
    tag = f"rank{rank} P={world} b={b} s={s} h={h} hkv={hkv} d={d} {dtype} causal={causal} {layout}"
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype, f"{tag}: {name} dtype {g.dtype}"
        if errors is not None:
            errors[name] = rel_err(g, w)
        else:
            assert_close(f"{tag}: {name}", g, w, dtype)
    return [t.detach().clone() for t in got]
