"""q, k, v of different dtypes are ONE SPConfigError naming q, k, v and their dtypes (and that one dtype is
valid) in every public function and every ``make_attention`` mode, on every rank, never a silent upcast
(issue #51 item 1: ring_attention(float64, float32, float64) returned float64 with a 1.5e-7 error)."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.config import MODES
from tests.harness import run_ranks

B, H, D = 1, 8, 16
WORLD = 4


def _calls(group):
    """(name, fn(q, k, v) -> out): every public function (meshes with a ring stage and with P_u = 1) and every
    make_attention mode."""
    ring_mesh = spx.build_sp_mesh(group, num_heads=H, ulysses_size=1)   # pure ring: no Ulysses stage to refuse
    mixed_mesh = spx.build_sp_mesh(group, num_heads=H, ulysses_size=2)
    yield "ulysses", lambda q, k, v: spx.ulysses_attention(q, k, v, group)
    yield "ring", lambda q, k, v: spx.ring_attention(q, k, v, group)
    yield "tasp", lambda q, k, v: spx.ring_attention(q, k, v, group, variant="tasp")
    yield "ring+block_mask", lambda q, k, v: spx.ring_attention(
        q, k, v, group, block_mask=torch.ones(1, 2, 2, dtype=torch.bool), block_size=8)
    yield "hybrid(P_u=1)", lambda q, k, v: spx.hybrid_attention(q, k, v, ring_mesh)
    yield "hybrid(P_u=2)", lambda q, k, v: spx.hybrid_attention(q, k, v, mixed_mesh)
    yield "torus", lambda q, k, v: spx.torus_attention(q, k, v, mixed_mesh)
    for mode in MODES:
        cfg = spx.SPConfig(mode=mode, nodes=2 if mode in ("tas", "torus") else None,
                           ulysses_size=2 if mode in spx.config.MESH_MODES else None)
        yield f"make_attention({mode})", lambda q, k, v, cfg=cfg: spx.make_attention(cfg, group, num_heads=H)(
            q, k, v, causal=False)


# calls whose algorithm does not yet run sp/checks.py's check: hybrid_attention's pure-ring path (P_u = 1) and
# torus_attention live in sp/ring/hybrid.py and torus.py (the ring rework's files): each needs one line at its top,
# ``check_ring_inputs(q, k, v, layout, mesh.group)``. Strict: once it is there, these pass and the marker must go.
PENDING = ("hybrid(P_u=1)", "torus", "make_attention(torus)")


def _walk(rank, world, pending):
    group = dist.group.WORLD
    s_loc = 4
    bad = []
    for which in range(3):   # which of q, k, v has the odd dtype
        for name, fn in _calls(group):
            if (name in PENDING) != pending:
                continue
            qkv = [torch.randn(B, s_loc, H, D, dtype=torch.float64) for _ in range(3)]
            qkv[which] = qkv[which].float()
            try:
                fn(*qkv)
            except spx.SPConfigError as e:
                msg = str(e)
                want = [f"{n}: {t.dtype}" for n, t in zip("qkv", qkv)] + ["one dtype"]
                if not all(w in msg for w in want):
                    bad.append(f"{name} ({'qkv'[which]} float32): message lacks {want}: {msg}")
                continue
            except Exception as e:  # noqa: BLE001 - every call is reported
                bad.append(f"{name} ({'qkv'[which]} float32): {type(e).__name__}: {e}")
                continue
            bad.append(f"{name} ({'qkv'[which]} float32): ran")
    assert not bad, "\n".join(bad)
    return True


def test_mixed_dtypes_refused_by_name_everywhere():
    run_ranks(_walk, WORLD, False)


def test_mixed_dtypes_refused_by_hybrid_ring_and_torus():
    run_ranks(_walk, WORLD, True, timeout=30)  # torus hung before the check: fail fast


def test_one_dtype_still_runs():
    """The check refuses only a real mismatch: three float32 shards of one dtype run (no false refusal)."""
    def one(rank, world):
        qkv = [torch.randn(B, 4, H, D) for _ in range(3)]
        return spx.ring_attention(*qkv, dist.group.WORLD).dtype
    assert run_ranks(one, 2) == [torch.float32, torch.float32]
