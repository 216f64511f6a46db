"""The keyword forms are a thin adapter of the problem path (#85 item 1): for every public function (and the
factory's attention) and every setting of the problem (causal + zigzag placement, padding + softmax scale, packed
samples, a block mask with its tile under its old name ``block_size``, the "sbhd" layout), the call with the settings
as keywords (``problem_from_keywords``) and the call with an ``AttentionProblem`` built once give the same output
and input gradients bit for bit, or the same refusal; and both equal the float64 full-sequence reference.
gloo, CPU, P=2, float64."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext import AttentionProblem, SPConfig, SPConfigError
from tests.harness import run_ranks
from tests.reference import reference_attention

S, H, D, TILE = 16, 4, 8, 4
T = S // TILE
CU = [0, 6, 16]
MASK = (torch.rand(1, T, T, generator=torch.Generator().manual_seed(7)) < 0.5) | torch.eye(T, dtype=torch.bool)

# (the problem's settings as the keyword forms take them, the same as AttentionProblem fields)
CASES = {
    "causal_zigzag": ({"causal": True, "placement": "zigzag"}, {"causal": True, "placement": "zigzag"}),
    "padding_scale": ({"kv_valid_len": 11, "softmax_scale": 0.3}, {"kv_valid_len": 11, "softmax_scale": 0.3}),
    "packed": ({"causal": True, "cu_seqlens": torch.tensor(CU, dtype=torch.int32)},
               {"causal": True, "cu_seqlens": torch.tensor(CU, dtype=torch.int32)}),
    "block_mask": ({"causal": True, "block_mask": MASK, "block_size": TILE},
                   {"causal": True, "block_mask": MASK, "tile": TILE}),
    "sbhd": ({"causal": True, "layout": "sbhd"}, {"causal": True, "layout": "sbhd"}),
}


def keep(fields: dict) -> torch.Tensor:
    """bool [S, S]: which keys each query attends, from the settings' definitions."""
    pos = torch.arange(S)
    out = torch.ones(S, S, dtype=torch.bool)
    if fields.get("causal"):
        out &= pos[None, :] <= pos[:, None]
    if fields.get("kv_valid_len") is not None:
        out &= pos[None, :] < fields["kv_valid_len"]
    if fields.get("cu_seqlens") is not None:
        sample = torch.bucketize(pos, torch.tensor(CU[1:]), right=True)
        out &= sample[None, :] == sample[:, None]
    if fields.get("block_mask") is not None:
        tile = pos // TILE
        out &= fields["block_mask"][0][tile][:, tile]
    return out


def _calls(world: int, fields: dict) -> dict:
    g = dist.group.WORLD
    layout, placement = fields.get("layout", "bshd"), fields.get("placement", "contiguous")
    mesh = spx.build_sp_mesh(g, num_heads=H, placement="tas", ulysses_size=world, nodes=world)
    made = {m: spx.make_attention(SPConfig(mode=m), g, num_heads=H, layout=layout, placement=placement)
            for m in ("hcms", "ring")}

    def factory(m):
        def call(q, k, v, p, **kw):
            kw = {n: x for n, x in kw.items() if n not in ("layout", "placement")}   # the attention's own
            return made[m](q, k, v, p, **kw)
        return call
    return {"ulysses": lambda q, k, v, p, **kw: spx.ulysses_attention(q, k, v, g, p, **kw),
            "ring": lambda q, k, v, p, **kw: spx.ring_attention(q, k, v, g, p, **kw),
            "hybrid": lambda q, k, v, p, **kw: spx.hybrid_attention(q, k, v, mesh, p, **kw),
            "torus": lambda q, k, v, p, **kw: spx.torus_attention(q, k, v, mesh, p, **kw),
            "make_attention_hcms": factory("hcms"), "make_attention_ring": factory("ring")}


def _run(call, q, k, v, do, problem, keywords, sharding):
    """(out, dq, dk, dv) over the full sequence (gathered) of one call, or the refusal's message."""
    mine = [spx.shard_sequence(t, dist.group.WORLD, **sharding).requires_grad_() for t in (q, k, v)]
    try:
        out = call(*mine, problem, **keywords)
    except SPConfigError as e:
        return str(e)
    out.backward(spx.shard_sequence(do, dist.group.WORLD, **sharding))
    return tuple(spx.unshard_sequence(t, dist.group.WORLD, **sharding) for t in (out, *(m.grad for m in mine)))


def _keywords_equal_problem(rank, world, case):
    keywords, fields = CASES[case]
    layout = fields.get("layout", "bshd")
    sharding = {"placement": fields.get("placement", "contiguous"), "cu_seqlens": fields.get("cu_seqlens"),
                "seq_dim": 0 if layout == "sbhd" else 1}
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(1, S, H, D, generator=g, dtype=torch.float64) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, softmax_scale=fields.get("softmax_scale"), mask=keep(fields))
    ref.backward(do)
    expected = (ref.detach(), qr.grad, kr.grad, vr.grad)
    if layout == "sbhd":
        q, k, v, do = (t.transpose(0, 1).contiguous() for t in (q, k, v, do))
        expected = tuple(t.transpose(0, 1) for t in expected)
    ran = {}
    for name, call in _calls(world, fields).items():
        by_keywords = _run(call, q, k, v, do, None, keywords, sharding)
        problem = AttentionProblem(**fields)
        by_problem = [_run(call, q, k, v, do, problem, {}, sharding) for _ in range(2)]   # reused: same again
        for got in by_problem:
            if isinstance(by_keywords, str) or isinstance(got, str):
                assert by_keywords == got, (name, by_keywords, got)   # the same refusal, by name
                continue
            for a, b in zip(by_keywords, got):
                assert torch.equal(a, b), name
        if isinstance(by_keywords, str):
            ran[name] = by_keywords
            continue
        for what, a, b in zip(("out", "dq", "dk", "dv"), by_keywords, expected):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name} {what}: {m}")
        ran[name] = "ok"
    return ran


@pytest.mark.parametrize("case", sorted(CASES))
def test_keywords_and_problem_give_the_same_attention(case):
    ran = run_ranks(_keywords_equal_problem, 2, case, timeout=120)
    assert ran[0] == ran[1]
    assert set(ran[0].values()) == {"ok"}, ran[0]   # every form runs every case (none refused)
