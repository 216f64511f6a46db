"""--sparse-attention tiles (issue #45, the DiT side): the tile order, the window / top-k block masks, the coarse
branch, the one-device block-sparse reference, the DiT's sparse step at SP=1 (runs, all-true mask = dense),
the flag refusals, and the sparse step at SP=2/4 equal to SP=1 (both entry points; these need ``block_mask=`` in
megatron_sp_ext's SPAttention)."""
import os

import pytest
import torch
import torch.distributed as dist

from megatron_sp_ext.errors import SPConfigError
from tests.reference import rel_err
from training.video_dit import VideoDiT, preset
from training.video_dit.data import SyntheticVideoLatents
from training.video_dit.engine import flow_matching_batch, local_loss, make_core, prepare
from training.video_dit.model import patchify, unpatchify
from training.video_dit.sparse import (SparseSpec, reference_sparse_attention, check_tile_grid, coarse_attention,
                                       num_tiles_of, pad_tile_mask, pool_tiles, row_major_ids, tile_coords, tile_order,
                                       tile_positions,
                                       tile_token_mask, topk_tile_mask, window_tile_mask)

CFG = preset("tiny")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- tile order -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("grid,tile", [((4, 4, 4), (2, 2, 2)), ((2, 6, 4), (1, 3, 2)), ((3, 2, 5), (3, 2, 5)),
                                       ((2, 2, 2), (1, 1, 1))])
def test_tile_order_round_trips_and_tiles_are_contiguous(grid, tile):
    perm, inv = tile_order(grid, tile)
    n = grid[0] * grid[1] * grid[2]
    assert sorted(perm.tolist()) == list(range(n))
    assert torch.equal(perm[inv], torch.arange(n)) and torch.equal(inv[perm], torch.arange(n))
    block = tile[0] * tile[1] * tile[2]
    t_n, h_n, w_n = grid
    coords = [(i // (h_n * w_n), (i // w_n) % h_n, i % w_n) for i in perm.tolist()]
    tiles_seen = []
    for j in range(n // block):  # block j: the tokens of one tile, in (t, h, w) order
        members = coords[j * block:(j + 1) * block]
        tile_ids = {(t // tile[0], h // tile[1], w // tile[2]) for t, h, w in members}
        assert len(tile_ids) == 1, (j, members)
        assert members == sorted(members)
        tiles_seen.append(tile_ids.pop())
    assert tiles_seen == sorted(tiles_seen)  # tiles in (t, h, w) order
    # a latent survives patchify -> tile order -> row-major -> unpatchify
    lat = torch.randn(1, 2, t_n, 2 * h_n, 2 * w_n)
    tokens = patchify(lat, (1, 2, 2))
    assert torch.equal(unpatchify(tokens[:, perm][:, inv], (1, 2, 2), 2, grid), lat)


def test_row_major_ids_and_tile_positions_keep_padding():
    grid, tile = (2, 4, 4), (1, 2, 2)
    perm, inv = tile_order(grid, tile)
    positions = torch.arange(28, 36)  # the last shard of 36 padded positions: 32..35 are padding
    ids = row_major_ids(positions, perm)
    assert torch.equal(ids[:4], perm[28:32]) and torch.equal(ids[4:], positions[4:])
    assert torch.equal(tile_positions(ids, grid, tile), positions)


def test_grids_the_tile_does_not_cut_run_with_edge_blocks_compacted():
    """#53: Wan's grids are cut by no power-of-two tile; they run (no refusal, no padding): whole blocks first, each
    one tile of consecutive positions with its own coordinates, then the edge blocks' tokens, every token once."""
    grid, tile = (5, 6, 10), (2, 4, 4)
    perm, inv = tile_order(grid, tile)
    n, vol = 5 * 6 * 10, 32
    assert sorted(perm.tolist()) == list(range(n)) and torch.equal(perm[inv], torch.arange(n))
    t, h, w = perm // 60, perm // 10 % 6, perm % 10
    whole = (t < 4) & (h < 4) & (w < 8)          # blocks the grid does not cut: 2 x 1 x 2
    assert bool(whole[:4 * vol].all()) and not bool(whole[4 * vol:].any())
    coords = tile_coords(grid, tile)
    assert coords.shape == (num_tiles_of(grid, tile), 3) and num_tiles_of(grid, tile) == -(-n // vol)
    for j in range(4):                            # a whole block: one tile, its own block coordinates
        members = perm[j * vol:(j + 1) * vol]
        assert len({(int(a) // 2, int(b) // 4, int(c) // 4) for a, b, c in zip(members // 60, members // 10 % 6,
                                                                               members % 10)}) == 1
        assert tuple(coords[j].tolist()) == (int(t[j * vol]) // 2, int(h[j * vol]) // 4, int(w[j * vol]) // 4)
    with pytest.raises(SPConfigError, match="--sparse-tile=0,4,4 is invalid"):
        check_tile_grid(grid, (0, 4, 4))


# ---- masks ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("grid,tile,window", [((4, 4, 6), (2, 2, 2), (0, 0, 0)), ((4, 4, 6), (1, 2, 2), (1, 0, 1)),
                                              ((6, 2, 4), (2, 1, 2), (1, 1, 0)), ((2, 2, 2), (1, 1, 1), (5, 5, 5))])
def test_window_mask_matches_token_distance_definition(grid, tile, window):
    """Brute force over token pairs in row-major order: token (t, h, w) sees token (t', h', w') iff their tiles
    are at most the window apart on each axis; compared through the tile order."""
    mask = window_tile_mask(grid, tile, window)
    assert mask.shape[0] == 1 and mask.dtype == torch.bool
    perm, inv = tile_order(grid, tile)
    block = tile[0] * tile[1] * tile[2]
    n = perm.numel()
    got = tile_token_mask(mask, block, n)[0][inv][:, inv]  # row-major x row-major
    t_n, h_n, w_n = grid
    coord = [(i // (h_n * w_n), (i // w_n) % h_n, i % w_n) for i in range(n)]
    want = torch.tensor([[all(abs(a // s - b // s) <= r for a, b, s, r in zip(coord[i], coord[j], tile, window))
                          for j in range(n)] for i in range(n)])
    assert torch.equal(got, want)


def test_topk_mask_counts_and_picks_the_highest_scores():
    torch.manual_seed(0)
    q_tiles, k_tiles = torch.randn(3, 10, 8), torch.randn(3, 10, 8)
    for k in (1, 4, 10, 15):
        mask = topk_tile_mask(q_tiles, k_tiles, k)
        assert mask.shape == (3, 10, 10) and mask.dtype == torch.bool
        assert (mask.sum(-1) == min(k, 10)).all()
        scores = q_tiles @ k_tiles.transpose(-1, -2)
        worst_kept = scores.masked_fill(~mask, float("inf")).amin(-1)
        best_dropped = scores.masked_fill(mask, float("-inf")).amax(-1)
        assert (worst_kept >= best_dropped).all()


def test_pad_block_mask():
    mask = torch.ones(2, 3, 3, dtype=torch.bool)
    padded = pad_tile_mask(mask, 5)
    assert padded.shape == (2, 5, 5) and padded[:, :3, :3].all()
    assert not padded[:, 3:].any() and not padded[:, :, 3:].any()


# ---- coarse branch and the one-device block-sparse reference ---------------------------------------------------

def test_pool_tiles_and_coarse_branch_shapes_values_and_gradients():
    torch.manual_seed(1)
    b, s, h, d, block = 2, 12, 3, 4, 4  # 3 tiles of 4 tokens + 2 padding tokens
    x = torch.randn(b, s + 2, h, d, requires_grad=True)
    tile_index = torch.arange(s + 2) // block
    pooled = pool_tiles(x, tile_index, 3)
    assert pooled.shape == (b, h, 3, d)
    assert torch.allclose(pooled, x[:, :s].detach().view(b, 3, block, h, d).mean(2).transpose(1, 2), atol=1e-6)
    q, k, v = (torch.randn(b, s + 2, h, d, requires_grad=True) for _ in range(3))
    out = coarse_attention(pool_tiles(q, tile_index, 3), pool_tiles(k, tile_index, 3), pool_tiles(v, tile_index, 3),
                           tile_index)
    assert out.shape == (b, s + 2, h, d)
    assert (out[:, s:] == 0).all()  # padding tokens
    assert torch.equal(out[:, 0], out[:, 3]) and not torch.equal(out[:, 3], out[:, 4])  # one value per tile
    out.square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad[:, :s].abs().sum() > 0 and (t.grad[:, s:] == 0).all()


def test_block_sparse_reference_equals_masked_dense_and_zero_rows():
    torch.manual_seed(2)
    b, s, h, d, block = 1, 10, 2, 4, 4  # 3 blocks, the last one partial
    q, k, v = (torch.randn(b, s, h, d, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[[1, 0, 1], [0, 1, 0], [0, 0, 0]], [[1, 1, 1], [1, 1, 1], [1, 1, 1]]], dtype=torch.bool)
    out = reference_sparse_attention(q, k, v, mask, block)
    for head in range(h):
        for i in range(s):
            keys = [j for j in range(s) if mask[head, i // block, j // block]]
            if not keys:
                assert (out[0, i, head] == 0).all()
                continue
            w = torch.softmax(q[0, i, head] @ k[0, keys, head].T / d ** 0.5, -1)
            assert torch.allclose(out[0, i, head], w @ v[0, keys, head], atol=1e-6)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    dense = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    full = reference_sparse_attention(q, k, v, torch.ones(1, 3, 3, dtype=torch.bool), block)
    assert torch.allclose(full, dense, atol=1e-6)
    with pytest.raises(SPConfigError, match=r"expected \[H or 1, 3, 3\]"):
        reference_sparse_attention(q, k, v, torch.ones(1, 2, 2, dtype=torch.bool), block)


# ---- the DiT's sparse step at SP=1 -----------------------------------------------------------------------------

def _awake(model, seed=11, gates=False):
    """Give the AdaLN-zero modulations (and, with ``gates``, the coarse branch's gates) random values: at init every
    block is the identity, so the attention would not reach the loss."""
    g = torch.Generator().manual_seed(seed)
    woken = dict(model.modulation_parameters())
    for name, p in model.named_parameters():
        if name in woken or (gates and "sparse_gate" in name):
            with torch.no_grad():
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _step(spec, group=None, frames=(4,), size=(8, 8), core=None, gates=False, micro=1):
    """(loss, grads by name, model) of one step of the tiny DiT on this rank (``group``: the SP group, None: one
    rank); ``core``: an attention core to install instead of make_core's."""
    torch.manual_seed(5)
    model = VideoDiT(CFG)
    model.set_sparse_attention(spec)
    _awake(model, gates=gates)
    sp = dist.get_world_size(group) if group is not None else 1
    model.set_attention_core(core or make_core("ulysses", group, num_heads=CFG.heads))
    data = SyntheticVideoLatents(CFG.in_channels, frames, size[0], size[1], CFG.text_len, CFG.text_dim, seed=1)
    batch = flow_matching_batch(data, 0, 7, 0, 1, micro, CFG.patch, tile=spec.tile if spec is not None else None)
    inp = prepare(batch, dist.get_rank(group) if group is not None else 0, sp, "cpu")
    loss_r = local_loss(model, inp)
    (loss_r * sp).backward()
    loss = loss_r.detach().clone()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if group is not None:
        dist.all_reduce(loss, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
            g /= sp
    return loss.item(), grads, model


def _close(got, ref, what, tol=1e-5):
    (l1, g1, _), (l0, g0, _) = got, ref
    assert abs(l1 - l0) <= tol * abs(l0), f"{what}: loss {l1} vs {l0}"
    for n, g in g0.items():
        assert rel_err(g1[n], g) < 10 * tol, f"{what}: grad {n} {rel_err(g1[n], g)}"


def test_window_covering_everything_equals_dense_sp1():
    """A window that reaches every tile is dense attention in tile order: the loss and every gradient of the dense
    model (the tile order changes only the summation order); a one-tile window differs."""
    dense = _step(None)
    _close(_step(SparseSpec((2, 2, 2), window=(5, 5, 5))), dense, "all-true window")
    local = _step(SparseSpec((2, 2, 2), window=(0, 0, 0)))
    assert abs(local[0] - dense[0]) > 1e-4 * abs(dense[0]), (local[0], dense[0])


def test_topk_all_tiles_with_zero_gate_equals_dense_sp1():
    """Top-k over every tile (K = nT = 8) with the coarse gate at its zero init: the dense loss and gradients (the
    gate's own gradient aside, which the dense model lacks: nonzero, so the gate learns); K=2 differs."""
    dense = _step(None)
    full = _step(SparseSpec((2, 2, 2), topk=8))
    _close(full, dense, "top-k over every tile")
    assert all(full[1][f"blocks.{i}.attn.sparse_gate.weight"].abs().sum() > 0 for i in range(CFG.layers))
    few = _step(SparseSpec((2, 2, 2), topk=2))
    assert abs(few[0] - dense[0]) > 1e-4 * abs(dense[0]), (few[0], dense[0])


def test_topk_self_attention_is_fine_plus_gated_coarse():
    """One block's sparse self-attention (top-k over every tile, random gate) = dense attention + gate(x) * the
    coarse branch computed by hand (pooled q/k/v per contiguous tile, softmax attention, repeated per token)."""
    from training.video_dit.sparse import sparse_step
    torch.manual_seed(3)
    grid, spec = (2, 4, 4), SparseSpec((1, 2, 2), topk=8)
    model = VideoDiT(CFG)
    model.set_sparse_attention(spec)
    attn = model.blocks[0].attn
    _awake(model, gates=True)
    perm, _ = tile_order(grid, spec.tile)
    x = torch.randn(2, 32, CFG.dim)
    angles = model.rope_cache.get(perm, grid, CFG.head_dim, "cpu")
    step = sparse_step(spec, perm, grid, None, torch.device("cpu"))
    got = attn(x, angles, None, sparse=step)
    q, k, v = attn.qkv(x).chunk(3, dim=-1)
    q = attn.ops.qk_prep(q, attn.norm_q.weight, attn.norm_q.eps, angles, attn.heads)
    k = attn.ops.qk_prep(k, attn.norm_k.weight, attn.norm_k.eps, angles, attn.heads)
    v = v.reshape(2, 32, attn.heads, attn.hd)
    dense = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    pooled = [t.reshape(2, 8, 4, attn.heads, attn.hd).mean(2).transpose(1, 2) for t in (q, k, v)]  # [B, H, 8, D]
    coarse = torch.softmax(pooled[0] @ pooled[1].transpose(-1, -2) / attn.hd ** 0.5, -1) @ pooled[2]
    coarse = coarse.repeat_interleave(4, dim=2).transpose(1, 2)  # [B, S, H, D]
    gate = attn.sparse_gate(x).view(2, 32, attn.heads, attn.hd)
    want = attn.out((dense + gate * coarse).reshape(2, 32, -1))
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
    assert gate.abs().sum() > 0 and rel_err(got, attn.out(dense.reshape(2, 32, -1))) > 1e-3


def test_sparse_step_micro_batch_sp1():
    """Two samples per micro-batch (one top-k mask each) give the mean of the two one-sample losses."""
    spec = SparseSpec((2, 2, 2), topk=3)
    both = _step(spec, micro=2)[0]
    assert torch.isfinite(torch.tensor(both))
    data = SyntheticVideoLatents(CFG.in_channels, (4,), 8, 8, CFG.text_len, CFG.text_dim, seed=1)
    singles = []
    for m in range(2):
        torch.manual_seed(5)
        model = VideoDiT(CFG)
        model.set_sparse_attention(spec)
        _awake(model)
        model.set_attention_core(make_core("ulysses", None, num_heads=CFG.heads))
        batch = flow_matching_batch(data, 0, 7, 0, 1, 2, CFG.patch, tile=spec.tile)
        one = {**batch, "x": batch["x"][m:m + 1], "target": batch["target"][m:m + 1], "t": batch["t"][m:m + 1],
               "text": batch["text"][m:m + 1]}
        singles.append(local_loss(model, prepare(one, 0, 1, "cpu")).item())
    assert abs(both - sum(singles) / 2) <= 1e-5 * abs(both), (both, singles)


def test_untiled_tokens_are_refused():
    spec = SparseSpec((2, 2, 2), window=(1, 1, 1))
    model = VideoDiT(CFG)
    model.set_sparse_attention(spec)
    data = SyntheticVideoLatents(CFG.in_channels, (4,), 8, 8, CFG.text_len, CFG.text_dim, seed=1)
    inp = prepare(flow_matching_batch(data, 0, 7, 0, 1, 1, CFG.patch), 0, 1, "cpu")  # row-major: no tile=
    with pytest.raises(SPConfigError, match="not one contiguous run of the tile order"):
        local_loss(model, inp)


def test_dense_default_has_no_new_parameters():
    """--sparse-attention none (and a window) keep the dense model's state dict; top-k adds only the gates."""
    plain = _step(None)
    assert list(VideoDiT(CFG).state_dict()) == list(plain[2].state_dict())
    window = VideoDiT(CFG)
    window.set_sparse_attention(SparseSpec((4, 4, 4), window=(1, 1, 1)))
    assert list(window.state_dict()) == list(plain[2].state_dict())
    topk = VideoDiT(CFG)
    topk.set_sparse_attention(SparseSpec((4, 4, 4), topk=1))
    extra = set(topk.state_dict()) - set(plain[2].state_dict())
    assert extra == {f"blocks.{i}.attn.sparse_gate.{w}" for i in range(CFG.layers) for w in ("weight", "bias")}


def test_sampling_in_tile_order_equals_dense_sp1():
    """sample_latents on a tiled model (window over every tile) gives the dense model's latents: the tokens go in
    tile order and come back row-major before unpatchify."""
    from training.video_dit.sample import sample_latents
    text = torch.randn(1, CFG.text_len, CFG.text_dim)
    out = []
    for spec in (None, SparseSpec((2, 2, 2), window=(5, 5, 5)), SparseSpec((2, 2, 2), window=(0, 0, 0))):
        torch.manual_seed(5)
        model = VideoDiT(CFG)
        model.set_sparse_attention(spec)
        _awake(model)
        out.append(sample_latents(model, text, (CFG.in_channels, 4, 8, 8), steps=2, seed=3))
    assert out[0].shape == (1, CFG.in_channels, 4, 8, 8)
    assert rel_err(out[1], out[0]) < 1e-5 and rel_err(out[2], out[0]) > 1e-4


# ---- SP=2/4 equals SP=1 ----------------------------------------------------------------------------------------

def _gathered_core(group):
    """A test core with ``block_mask``: all-gathers q, k, v (differentiably) and runs the one-device reference on
    the full sequence, keeping this rank's rows. Checks the DiT's side at SP>1 (tile order across ranks, pooled
    tiles summed over the group, the padded block count) independently of megatron_sp_ext's modes."""
    from torch.distributed.nn.functional import all_gather
    rank = dist.get_rank(group)

    def core(q, k, v, n=None, cu_seqlens=None, block_mask=None, block_size=None):
        full = [torch.cat(all_gather(t.contiguous(), group=group), dim=1) for t in (q, k, v)]
        s = q.shape[1]
        return reference_sparse_attention(*full, block_mask, block_size, n)[:, rank * s:(rank + 1) * s]
    core.group = group
    return core


# (spec, frames, latent HxW): 4x4x4 tokens in 8 tiles; 3x3x5 = 45 tokens in 3 tiles of 15 (SP-padded to 46 / 48,
# the shards cutting through tiles)
SP_CASES = [(SparseSpec((2, 2, 2), topk=3), (4,), (8, 8)), (SparseSpec((2, 2, 2), window=(0, 1, 0)), (4,), (8, 8)),
            (SparseSpec((1, 3, 5), topk=2), (3,), (6, 10)), (SparseSpec((1, 3, 5), window=(0, 0, 0)), (3,), (6, 10))]


def _sp_equals_sp1(rank, world, modes):
    for spec, frames, size in SP_CASES:
        ref = _step(spec, None, frames, size, gates=True)
        for mode, kw in modes:
            core = _gathered_core(dist.group.WORLD) if mode == "gathered" else \
                make_core(mode, dist.group.WORLD, num_heads=CFG.heads, **kw)
            _close(_step(spec, dist.group.WORLD, frames, size, core=core, gates=True), ref,
                   f"SP={world} {mode} {spec} frames {frames}")
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_sparse_step_sp_equals_sp1_through_a_gathered_core(world):
    from tests.harness import run_ranks
    run_ranks(_sp_equals_sp1, world, [("gathered", {})])


SP_MODES = {2: [("ulysses", {}), ("ring", {}), ("auto", {})],
            4: [("ulysses", {}), ("hcms", {"head_chunks": 2}), ("ring", {}), ("tasp", {}),
                ("usp", {"nodes": 2, "ulysses_size": 2}), ("tas", {"nodes": 2, "ulysses_size": 2}),
                ("torus", {"nodes": 2, "ulysses_size": 2, "placement": "tas"}), ("auto", {})]}


@pytest.mark.parametrize("world", [2, 4])
def test_sparse_step_every_mode_sp_equals_sp1(world):
    """The DiT's sparse step (top-k and window, padded or not) in every SP mode: SP=1's loss and gradients."""
    from tests.harness import run_ranks
    run_ranks(_sp_equals_sp1, world, SP_MODES[world])


def _entry_run(rank, world, entry, sp, sparse, steps=3, mode="ulysses"):
    flags = ["--sparse-attention", "tiles", *sparse] if sparse else []
    base = ["--model", "tiny", "--train-iters", str(steps), "--frames", "4,3", "--latent-size", "8x8",
            "--quiet", *flags]
    if entry == "megatron":
        from training import pretrain_video_dit
        return pretrain_video_dit.main(base + ["--context-parallel-size", str(sp), "--cp-comm-type", mode])["losses"]
    from training import train_deepspeed
    cfg = {"sequence_parallel_size": sp, "zero_optimization": {"stage": 1}, "sequence_parallel_ext": {"mode": mode}}
    return train_deepspeed.main(base + ["--deepspeed-config", os.path.join(ROOT, "configs", "deepspeed",
                                                                           "cpu_tiny_hcms.json")], config=cfg)["losses"]


# frames 4 and 3 at 8x8 latents (4x4 patches): tiles of 1x2x2 tokens
ENTRY_SPARSE = {"topk": ("--sparse-tile", "1,2,2", "--sparse-topk", "3"),
                "window": ("--sparse-tile", "1,2,2", "--sparse-window", "1,0,1")}


@pytest.mark.parametrize("entry", ["megatron", "deepspeed"])
def test_entry_sp1_window_over_everything_equals_dense_and_topk_trains(entry):
    """Both entry points at SP=1: a window over every tile trains as the dense model does (3 steps, the batches in
    tile order); top-k runs, its losses finite and its own."""
    pytest.importorskip("megatron.core" if entry == "megatron" else "deepspeed")
    from tests.harness import run_ranks
    dense = run_ranks(_entry_run, 1, entry, 1, None)[0]
    everything = run_ranks(_entry_run, 1, entry, 1, ("--sparse-tile", "1,2,2", "--sparse-window", "3,3,3"))[0]
    for a, b in zip(everything, dense):
        assert abs(a - b) <= 1e-5 * abs(b), (everything, dense)
    topk = run_ranks(_entry_run, 1, entry, 1, ENTRY_SPARSE["topk"])[0]
    assert len(topk) == 3 and all(torch.isfinite(torch.tensor(topk))) and topk != dense, (topk, dense)


@pytest.mark.parametrize("entry", ["megatron", "deepspeed"])
@pytest.mark.parametrize("kind", ["topk", "window"])
@pytest.mark.parametrize("sp,mode", [(2, "ulysses"), (4, "ring"), (4, "hcms")])
def test_entry_sparse_sp_equals_sp1(entry, kind, sp, mode):
    """Both entry points: 3 sparse steps at SP=2/4 give the SP=1 losses."""
    pytest.importorskip("megatron.core" if entry == "megatron" else "deepspeed")
    from tests.harness import run_ranks
    ref = run_ranks(_entry_run, 1, entry, 1, ENTRY_SPARSE[kind])[0]
    got = run_ranks(_entry_run, sp, entry, sp, ENTRY_SPARSE[kind], 3, mode)
    for r in range(sp):
        for a, b in zip(got[r], ref):
            assert abs(a - b) <= 1e-4 * abs(b), f"{entry} {kind} SP={sp} {mode}: {got[r]} vs {ref}"


# ---- flag refusals ---------------------------------------------------------------------------------------------

TINY_ARGS = ("--model", "tiny", "--frames", "4", "--latent-size", "8x8", "--quiet")
TILES = ("--sparse-attention", "tiles")


@pytest.mark.parametrize("entry", ["megatron", "deepspeed"])
@pytest.mark.parametrize("flags,match", [
    (("--sparse-topk", "2"), "--sparse-topk set with --sparse-attention none: add --sparse-attention tiles"),
    (("--sparse-tile", "2,2,2", "--sparse-window", "1,1,1"),
     "--sparse-tile / --sparse-window set with --sparse-attention none"),
    (TILES, "--sparse-attention tiles needs exactly one of --sparse-topk K"),
    (TILES + ("--sparse-topk", "2", "--sparse-window", "1,1,1"), "got both"),
    (TILES + ("--sparse-topk", "0"), "--sparse-topk=0 is invalid: use a positive whole number"),
    (TILES + ("--sparse-window", "1,1"), "--sparse-window='1,1' is invalid: use three non-negative whole numbers"),
    (TILES + ("--sparse-window", "1,-1,0"), "--sparse-window='1,-1,0' is invalid"),
    (TILES + ("--sparse-tile", "2,0,2", "--sparse-topk", "1"), "--sparse-tile='2,0,2' is invalid: use three positive"),
    (TILES + ("--sparse-tile", "a,b,c", "--sparse-topk", "1"), "--sparse-tile='a,b,c' is invalid"),
    (("--sparse-attention", "vsa"), "invalid choice: 'vsa' (choose from 'none', 'tiles')"),
    (TILES + ("--sparse-topk", "2", "--pack-samples", "--max-tokens-per-step", "100"),
     "--sparse-attention tiles cannot run --pack-samples"),
    (TILES + ("--sparse-topk", "2", "--ulysses-packed-qkv", "on"),
     "--ulysses-packed-qkv on cannot run --sparse-attention tiles"),
])
def test_flag_refusals(entry, flags, match, capsys):
    pytest.importorskip("megatron.core" if entry == "megatron" else "deepspeed")
    if entry == "megatron":
        from training.pretrain_video_dit import parse
    else:
        from training.train_deepspeed import parse
    with pytest.raises(SystemExit) as e:
        parse([*TINY_ARGS, *flags])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_megatron_entry_refuses_async_blocks_with_tiles(capsys):
    pytest.importorskip("megatron.core")
    from training.pretrain_video_dit import parse
    with pytest.raises(SystemExit) as e:
        parse([*TINY_ARGS, *TILES, "--sparse-topk", "2", "--cp-comm-type", "hcms", "--hcms-head-chunks", "2",
               "--sp-async-qkv", "on"])
    assert e.value.code == 2 and "--sp-async-qkv on cannot run --sparse-attention tiles" in capsys.readouterr().err


def test_tiles_that_do_not_cut_the_run_shapes_run():
    """--frames 4,3 at 8x8 latents: grids 4x4x4 and 3x4x4; tiles of 2 frames do not cut 3 frames: the run's shapes
    are accepted (edge blocks compacted, #53), and a tile that is not three positive sizes is refused by name."""
    import argparse
    from training.video_dit.cli import check_shapes
    args = argparse.Namespace(frames="4,3", latent_size="8x8", sparse_attention="tiles", sparse_tile="2,2,2",
                              sparse_topk=2, sparse_window=None)
    check_shapes(args, CFG)
    args.sparse_tile = "1,2,2"
    check_shapes(args, CFG)
