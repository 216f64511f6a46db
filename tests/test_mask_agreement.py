"""#53: a block mask that differs between ranks is refused by name (SPConfigError naming block_mask) on every rank,
before the first exchange, in every mode: never a hang (TASP hung until killed) or a crash (ring ranks died with
"Connection closed by peer"). Each case runs within the harness's timeout."""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.factory import make_attention
from tests.harness import run_ranks

S, H, D, BS = 64, 8, 8, 8


def _calls(world):
    g = dist.group.WORLD
    calls = {
        "ulysses": lambda q, m: spx.ulysses_attention(q, q, q, g, block_mask=m, block_size=BS),
        "hcms": lambda q, m: spx.ulysses_attention(q, q, q, g, head_chunks=2, block_mask=m, block_size=BS),
        "ring": lambda q, m: spx.ring_attention(q, q, q, g, block_mask=m, block_size=BS),
        "tasp": lambda q, m: spx.ring_attention(q, q, q, g, variant="tasp", block_mask=m, block_size=BS),
        "factory ring": lambda q, m: make_attention(spx.SPConfig(mode="ring"), g, num_heads=H)(
            q, q, q, causal=False, block_mask=m, block_size=BS),
    }
    if world == 4:
        usp = spx.build_sp_mesh(g, num_heads=H, placement="usp", ulysses_size=2, nodes=2)
        tas = spx.build_sp_mesh(g, num_heads=H, placement="tas", ulysses_size=2, nodes=2)
        calls["usp"] = lambda q, m: spx.hybrid_attention(q, q, q, usp, block_mask=m, block_size=BS)
        calls["torus"] = lambda q, m: spx.torus_attention(q, q, q, tas, block_mask=m, block_size=BS)
    return calls


def _refuse(rank, world):
    torch.manual_seed(0)
    q = torch.randn(1, S // world, H, D, dtype=torch.float64)
    same = torch.rand(1, S // BS, S // BS, generator=torch.Generator().manual_seed(1)) < 0.5
    mine = same.clone()
    mine[0, rank % (S // BS), 0] ^= rank > 0          # ranks > 0 flip one bit: their masks differ from rank 0's
    out = {}
    for name, call in _calls(world).items():
        call(q, same)                                  # the same mask on every rank runs
        try:
            call(q, mine)
            out[name] = "ran"
        except SPConfigError as e:
            out[name] = "refused" if "block_mask differs between ranks" in str(e) else str(e)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_mask_that_differs_between_ranks_is_refused_by_name(world):
    res = run_ranks(_refuse, world, timeout=180)
    for rank_res in res:
        assert rank_res and all(v == "refused" for v in rank_res.values()), rank_res


def _what_differs(rank, world):
    """The refusal says what differs: the shapes where they differ, else the first differing entry (the shapes, equal
    on every rank, were all it used to list)."""
    q = torch.randn(1, S // world, H, D, dtype=torch.float64)
    same = torch.rand(1, S // BS, S // BS, generator=torch.Generator().manual_seed(1)) < 0.5
    flipped = same.clone()
    flipped[0, 2, 3] ^= rank == world - 1                          # the last rank flips one entry
    shaped = same if rank == 0 else same.expand(H, -1, -1).clone()  # [1, T, T] on rank 0, [H, T, T] elsewhere
    said = []
    for mask in (flipped, shaped):
        with pytest.raises(SPConfigError) as e:
            spx.ring_attention(q, q, q, dist.group.WORLD, block_mask=mask, block_size=BS)
        said.append(str(e.value))
    return said


@pytest.mark.parametrize("world", [2, 4])
def test_refusal_says_what_differs(world):
    for entry, shaped in run_ranks(_what_differs, world, timeout=120):
        first = "[head 0, query tile 2, key tile 3]"
        assert (f"same shape (1, {S // BS}) on every rank; the selected tiles differ from rank 0's: rank {world - 1} "
                f"at 1 of {(S // BS) ** 2} entries, first {first}") in entry, entry
        assert f"shapes [heads, tiles]: rank 0 (1, {S // BS}), rank 1 ({H}, {S // BS})" in shaped, shaped
