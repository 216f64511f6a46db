"""Every public function that takes shards, called with DEFAULT arguments on shards from shard_sequence's
defaults, causal and not, at P=2 and P=4, float64: output and q/k/v gradients vs the single-device reference."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.sp.factory import make_attention
from tests.harness import run_ranks
from tests.reference import make_qkv, reference_attention, rel_err

B, H, D = 1, 8, 16
TOL = 1e-10


def _calls(group, world):
    """(name, fn(q, k, v, causal) -> out) for every public function, all placements left at their defaults."""
    mesh = spx.build_sp_mesh(group, num_heads=H)
    yield "ulysses", lambda q, k, v, c: spx.ulysses_attention(q, k, v, group, causal=c)
    yield "hcms", lambda q, k, v, c: spx.ulysses_attention(q, k, v, group, causal=c, head_chunks=2)
    yield "ring", lambda q, k, v, c: spx.ring_attention(q, k, v, group, causal=c)
    yield "tasp", lambda q, k, v, c: spx.ring_attention(q, k, v, group, causal=c, variant="tasp")
    yield "hybrid", lambda q, k, v, c: spx.hybrid_attention(q, k, v, mesh, causal=c)
    yield "torus", lambda q, k, v, c: spx.torus_attention(q, k, v, mesh, causal=c)

    def packed(q, k, v, c):
        sends = spx.pack_qkv(q, k, v, spx.packed_head_layout(H, H, world, 1))
        return spx.packed_ulysses_attention(sends, group, num_heads=H, num_kv_heads=H, causal=c)
    yield "packed_ulysses", packed
    for mode in ("ulysses", "hcms", "ring", "tasp", "usp", "tas", "torus", "auto"):
        cfg = spx.SPConfig(mode=mode, nodes=2 if mode in ("tas", "torus") else None)  # tas/torus need 2 machines
        yield f"make_attention({mode})", lambda q, k, v, c, cfg=cfg: make_attention(cfg, group, num_heads=H)(
            q, k, v, causal=c)


def _walk(rank, world):
    group = dist.group.WORLD
    s = 4 * world * 2
    bad = []
    for causal in (False, True):
        q, k, v, do = (t.double() for t in make_qkv(7 + causal, B, s, H, H, D))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = reference_attention(*full, causal=causal)
        ref.backward(do)
        for name, fn in _calls(group, world):
            shards = [spx.shard_sequence(t, group).detach().requires_grad_() for t in (q, k, v)]
            try:
                out = fn(*shards, causal)
                out.backward(spx.shard_sequence(do, group))
            except Exception as e:  # noqa: BLE001 - every call is reported, not only the first
                bad.append(f"{name} causal={causal}: {type(e).__name__}: {e}")
                continue
            got = [spx.unshard_sequence(t, group) for t in (out, *(x.grad for x in shards))]
            for what, x, r in zip(("out", "dq", "dk", "dv"), got, (ref, *(t.grad for t in full))):
                e = rel_err(x, r.detach())
                if not e < TOL:
                    bad.append(f"{name} causal={causal} {what}: rel err {e:.3g}")
    x = torch.randn(2, s, 3, dtype=torch.float64)
    assert torch.equal(spx.unshard_sequence(spx.shard_sequence(x, group), group), x)
    assert not bad, "\n".join(bad)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_every_default_call_matches_reference(world):
    run_ranks(_walk, world)


def test_every_public_backend_default_is_spconfigs():
    """Defaults agree: every public function (and entry helper, and the layers' LayerRun) that takes a local-attention
    ``backend`` defaults to what SPConfig defaults to ("auto"); "sdpa" stays an accepted alias of it."""
    import dataclasses
    import inspect

    from megatron_sp_ext.attention.backends import AUTO_NAMES, get_backend
    from megatron_sp_ext.config import SPConfig
    from megatron_sp_ext.sp.layers.call import LayerRun
    from training.video_dit import engine

    default = next(f.default for f in dataclasses.fields(SPConfig) if f.name == "backend")
    fns = [spx.ulysses_attention, spx.ring_attention, spx.hybrid_attention, spx.torus_attention,
           spx.packed_ulysses_attention, spx.PackedUlysses.__init__, LayerRun.__init__,   # the layers' backend
           engine.make_core]
    try:   # DeepSpeed's attention takes SPConfig's own settings (**settings): its default is SPConfig's
        from megatron_sp_ext.deepspeed.attention import SPDistributedAttention
        params = inspect.signature(SPDistributedAttention.__init__).parameters
        assert "backend" not in params and params["settings"].kind is inspect.Parameter.VAR_KEYWORD
    except ImportError:   # deepspeed not installed: the others still agree
        pass
    got = {f.__qualname__: inspect.signature(f).parameters["backend"].default for f in fns}
    assert default == "auto" and set(got.values()) == {default}, got
    assert "sdpa" in AUTO_NAMES and type(get_backend("sdpa")) is type(get_backend("auto"))
