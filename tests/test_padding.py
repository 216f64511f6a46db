"""Key padding (kv_valid_len): padded keys get no attention, in every algorithm (gloo, CPU)."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.sp.placement import pieces
from tests.harness import run_ranks
from tests.sp_check import run_case


def _padded(rank, world, algo):
    g = dist.group.WORLD
    s = 4 * world * 3
    valid = s - 5  # the last 5 tokens are padding
    mask = torch.zeros(s, s, dtype=torch.bool)
    mask[:, :valid] = True
    n = 0
    for causal in (False, True):
        m = mask & torch.ones(s, s, dtype=torch.bool).tril() if causal else mask
        pl = "zigzag" if causal else "contiguous"

        def shard(x, r, w, pl=pl):
            return torch.cat([x[:, a:a + k] for a, k in pieces(pl, r, w, x.shape[1])], dim=1)
        if algo == "ulysses":
            fn = lambda q, k, v: spx.ulysses_attention(q, k, v, g, head_chunks=2, causal=causal, placement=pl,  # noqa
                                                       kv_valid_len=valid)
        elif algo in ("ring", "tasp"):
            fn = lambda q, k, v: spx.ring_attention(q, k, v, g, variant=algo, causal=causal, placement=pl,  # noqa
                                                    kv_valid_len=valid)
        else:
            mesh = spx.build_sp_mesh(g, num_heads=8, placement="tas", ulysses_size=2, nodes=2)
            f = spx.hybrid_attention if algo == "hybrid" else spx.torus_attention
            fn = lambda q, k, v: f(q, k, v, mesh, causal=causal, placement=pl, kv_valid_len=valid)  # noqa
        # padded query rows are never compared: their outputs are don't-care, their grads must be 0
        out, dq, dk, dv = run_case(fn, rank, world, b=1, s=s, h=8, hkv=8, d=16, dtype=torch.float32, causal=causal,
                                   shard=shard, mask=m, seed=n, compare_rows=valid)
        n += 1
    return n


@pytest.mark.parametrize("algo", ["ulysses", "ring", "tasp", "hybrid", "torus"])
def test_padding_is_masked(algo):
    run_ranks(_padded, 4, algo)


MODES = ("ulysses", "hcms", "ring", "tasp", "usp", "tas", "torus", "auto")


def _no_key_left(rank, world):
    """kv_valid_len 0 or negative leaves no key to attend: every mode (the factory's attention and the functional
    API) and the async block plan refuse it by name instead of returning zeros."""
    from megatron_sp_ext.config import SPConfig
    from megatron_sp_ext.errors import SPConfigError
    from megatron_sp_ext.sp.factory import make_attention
    from megatron_sp_ext.sp.layers.async_qkv import make_async_plan
    g = dist.group.WORLD
    q = torch.randn(1, 4, 8, 16)
    mesh = spx.build_sp_mesh(g, num_heads=8, placement="tas", ulysses_size=min(2, world), nodes=2)
    functional = {"ulysses_attention": lambda n: spx.ulysses_attention(q, q, q, g, kv_valid_len=n),
                  "ring_attention": lambda n: spx.ring_attention(q, q, q, g, kv_valid_len=n),
                  "hybrid_attention": lambda n: spx.hybrid_attention(q, q, q, mesh, kv_valid_len=n),
                  "torus_attention": lambda n: spx.torus_attention(q, q, q, mesh, kv_valid_len=n),
                  "make_async_plan": lambda n: make_async_plan(g, spx.AttentionProblem(kv_valid_len=n), num_heads=8,
                                                               num_kv_heads=8, head_dim=16, prep=None, seq_local=4,
                                                               device=q.device)}
    for mode in MODES:
        kw = {"nodes": 2} if mode in ("usp", "tas", "torus") else {}
        attn = make_attention(SPConfig(mode=mode, head_chunks=2 if mode != "ulysses" else 1, **kw), g, num_heads=8)
        functional[mode] = lambda n, attn=attn: attn(q, q, q, causal=False, kv_valid_len=n)
    refused = []
    for name, call in functional.items():
        for n in (0, -3):
            with pytest.raises(SPConfigError, match=rf"kv_valid_len={n} leaves no key to attend: use 1\.\.{4 * world}"):
                call(n)
            refused.append((name, n))
    # 1 key is a valid cut (the first key only): every mode runs it
    one = [functional[mode](1) for mode in MODES]
    assert all(torch.isfinite(o).all() and o.abs().sum() > 0 for o in one)
    return len(refused)


@pytest.mark.parametrize("world", [2, 4])
def test_no_key_left_is_refused_in_every_mode(world):
    assert run_ranks(_no_key_left, world, timeout=120) == [2 * (len(MODES) + 5)] * world
