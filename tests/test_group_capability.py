"""Modes check that their group can run them before the first exchange (#44): a gloo group cannot send or receive
CUDA tensors point to point (the send fails and breaks the group), so the ring family is refused by name there and
``auto`` never calibrates a candidate that needs it. On the CPU the gloo-with-CUDA-tensors case is declared through
``comm.capability.p2p_unavailable_reason`` (the CUDA suite's auto family runs the real one on a GPU)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.comm import capability
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp import factory
from megatron_sp_ext.sp.factory import make_attention
from tests.harness import run_ranks

H, D = 8, 16


def test_which_modes_need_point_to_point():
    assert [m for m in ("ulysses", "hcms", "ring", "tasp", "usp", "tas", "torus") if capability.needs_p2p(m, 4)] == \
        ["ring", "tasp", "usp", "tas", "torus"]
    assert not capability.needs_p2p("ring", 1)
    assert capability.p2p_unavailable_reason(None, torch.device("cuda")) is None
    assert capability.p2p_unavailable_reason(None, torch.device("cpu")) is None


def _declare_gloo_cuda(monkeypatch):
    fake = lambda group, device: capability.GLOO_CUDA_P2P if group is not None else None  # noqa: E731
    monkeypatch.setattr(capability, "p2p_unavailable_reason", fake)
    monkeypatch.setattr(factory, "p2p_unavailable_reason", fake)


def _worker(rank, world):
    g, out = dist.group.WORLD, {}
    q = torch.randn(1, 8, H, D)
    for mode in ("ring", "tasp", "usp", "torus"):
        attn = make_attention(spx.SPConfig(mode=mode, nodes=2 if mode in ("usp", "torus") and world == 4 else None,
                                           source="megatron"), g, num_heads=H)
        try:
            attn(q, q, q, causal=False)
            out[mode] = "ran"
        except SPConfigError as e:
            out[mode] = str(e)
    seen = []
    auto = make_attention(spx.SPConfig(mode="auto"), g, num_heads=H)
    auto.res.mode_policy.fastest_for = lambda q_, k_, group, cands, **kw: seen.append(sorted(cands)) or "hcms"
    ref = spx.ulysses_attention(q, q, q, g, head_chunks=auto.chunks)
    got = auto(q, q, q, causal=False)
    out["auto_equal"] = bool(torch.equal(got, ref))
    out["auto_candidates"] = seen
    for name, fn in (("ring_attention", lambda: spx.ring_attention(q, q, q, g)),
                     ("tasp_attention", lambda: spx.ring_attention(q, q, q, g, variant="tasp"))):
        try:
            fn()
            out[name] = "ran"
        except SPConfigError as e:
            out[name] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ring_family_refused_and_auto_leaves_it_out_on_gloo_with_cuda_tensors(monkeypatch, world):
    _declare_gloo_cuda(monkeypatch)
    for res in run_ranks(_worker, world):
        assert res["ring"].startswith("--cp-comm-type='ring' cannot run on this process group with CUDA tensors: "
                                      "a gloo group cannot send or receive CUDA tensors point to point"), res["ring"]
        assert "use an NCCL group for CUDA tensors, or --cp-comm-type ulysses or hcms" in res["ring"]
        assert res["tasp"].startswith("--cp-comm-type='tasp' cannot run")   # its steps are send/recv pairs too
        if world == 4:
            assert "cannot run" in res["usp"] and "cannot run" in res["torus"]
        assert res["auto_equal"]
        # only Ulysses/HCMS is left: nothing is calibrated, no ring step is ever tried
        assert res["auto_candidates"] == []
        assert "ring_attention(variant='ring') cannot run" in res["ring_attention"]
        assert "ring_attention(variant='tasp') cannot run" in res["tasp_attention"]


def _plain(rank, world):
    q = torch.randn(1, 8, H, D)
    out = make_attention(spx.SPConfig(mode="ring"), dist.group.WORLD, num_heads=H)(q, q, q, causal=False)
    return tuple(out.shape)


def test_cpu_tensors_on_gloo_run_every_mode():
    assert run_ranks(_plain, 2) == [(1, 8, H, D)] * 2
