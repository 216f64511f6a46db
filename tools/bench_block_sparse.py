r"""Block-sparse attention (#45) on ONE GPU, one job: the dense kernel floor, the block-sparse local kernel as
Ulysses runs it, and the sparse ring's placement emulated on one GPU (skip counts from the plan, kernel time of
the steps that run; NO communication is timed).

Masks (one per sequence length S, heads H, tile size --block-size and target sparsity s in --sparsities; tiles of
--tile tokens T,H,W per block size, default 64: 4,4,4 and 128: 4,4,8):
  random   per head and query tile, round((1 - s) * nT) key tiles drawn at random (seeded): top-k-like
           (``--sparse-topk``'s shape of mask, not its choice of tiles); [H, nT, nT]
  topk     the DiT's own selection (``training.video_dit.sparse.topk_tile_mask``, VSA's plain top-k) of
           round((1 - s) * nT) key tiles per head and query tile, on synthetic pooled q/k tiles that are smooth over
           the tile grid plus noise (``synthetic_tiles``): local with long-range picks, per head; [H, nT, nT]
  window   ``training.video_dit.sparse.window_tile_mask`` on the token grid ``grid_for(S)`` (in tile order), the
           most even window (wt, wh, ww) within 0.02 of s, else the nearest (``window_for_sparsity``); [1, nT, nT].
The actual sparsity of every mask is in its row.

Rows (bf16, B=1, D=128, non-causal: the video DiT's self-attention):
  dense        the dense local kernel (``backends.get_backend(name)``: ``dense_fns``) at
               [1, H/P, S, D] for P in --ulysses-p (the floor of a P-way Ulysses rank), and at [1, H, S/P, D] for P
               in --ring-p (one dense ring step)
  ulysses      the block-sparse local kernel Ulysses runs after its exchange: the full sequence, H/P heads (the
               mask's rows of heads 0..H/P-1), kernel "flex" on CUDA (BlockMask built once, outside the timing;
               its build time is ``mask_build_ms``), "math" on CPU
  ring         placement --placement over P ranks (``sparse_ring_plan(...).counts(rank)`` for every rank: steps
               run / skipped, K|V bytes sent / skipped, dK|dV bytes sent / skipped); for rank 0 and the busiest
               rank (most steps run) the kernel of every step that runs, (local q, that step's K|V) with its token
               mask, timed one by one and summed: ``run_steps_*_ms`` is KERNEL TIME OF THE RUN STEPS ONLY (no
               send/receive, no merge). Kernels: "math" (what the sparse ring runs today on every device:
               ``block_sparse.math_forward`` + ``math_backward`` from the step's own out/lse) and "flex" (what a
               flex ring step would cost: forward + autograd backward).
Every timed row: ms (median of --iters, ring steps --ring-iters; CUDA events via ``calibration.time_ms``, host clock
on CPU; the first call, which compiles, is ``first_call_s`` and is not in the median) and TFLOP/s of USEFUL
work: 4 * D * (selected query-key pairs) per head for the forward, 3.5x that for forward+backward (the dense rows
count every pair). A row that runs out of memory records ``error`` and the job goes on. Calls longer than
--long-ms stop after 2 timed repetitions (one warmup after the first call): the 128K rows take seconds per call.
--budget-s stops starting rows once that much time has passed (the JSON says what is left); --resume keeps the
rows of an earlier run's JSON in --out and runs only the missing ones, so one table can take several device calls
on one machine (each row's ``utc`` says when it ran, ``gpu`` on which GPU). --table-kernels splits the table's
kernels over jobs on several GPUs of one host (each times the dense floor of its sizes); --merge joins their JSONs
into one, keeping a dense row timed twice as a cross-check of the GPUs. Ulysses rows' ratio to dense FA4 (same S, H,
P; the same GPU where timed there) is a column of the table.

    python tools/bench_block_sparse.py --out $OUT                      # S 32K,128K, H 12, s 0.5,0.8,0.9
    python tools/bench_block_sparse.py --heads 40 --out $OUT           # wan-14b heads
    python tools/bench_block_sparse.py --table --out $OUT --resume    # #53's table: S 32K/75K/128K, H 40/5,
                                                                      # s .5-.95, 3 masks, 64/128 tiles, no ring
    python tools/bench_block_sparse.py --table --table-kernels flex --out A   # one GPU: the flex rows, and so on
    python tools/bench_block_sparse.py --table --table-kernels cudnn_block_sparse,fa4 --table-seqlens 32768,75776 \
        --table-sparsities 0.8,0.9,0.95 --out C            # #69: cuDNN's block sparsity beside FA4's, 64/128 tiles
    python tools/bench_block_sparse.py --out T --merge A B             # one table from the parts
    python tools/bench_block_sparse.py --smoke --out /tmp/bs           # CPU, S=512, tiny (the test)
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
import time
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_sp_ext.attention import backends, block_sparse, kernels  # noqa: E402
from megatron_sp_ext.attention.tiles import TileSlice  # noqa: E402
from megatron_sp_ext.sp.calibration import time_ms, wall_time_ms  # noqa: E402
from megatron_sp_ext.sp.placement import positions  # noqa: E402
from megatron_sp_ext.sp.ring.sparse import sparse_ring_plan  # noqa: E402
from tools.benchlib import git_commit, run_meta, write_json  # noqa: E402
from training.video_dit.sparse import tile_coords, topk_tile_mask, window_tile_mask  # noqa: E402

Fns = tuple[Callable[[], object], Callable[[], object]]


# ------------------------------------------------------------------------------------------------ masks
def grid_for(seq_len: int, tile: tuple) -> tuple:
    """A (T', H', W') token grid of exactly ``seq_len`` tokens cut into whole ``tile``s: the tile counts
    (a <= b <= c, a * b * c = seq_len / tile volume) with the smallest c / a (the most cube-like video)."""
    vol = math.prod(tile)
    if seq_len % vol:
        raise SystemExit(f"S={seq_len} is not a multiple of the tile volume {vol} (--tile {tile})")
    n = seq_len // vol
    best = None
    for a in range(1, n + 1):
        if n % a:
            continue
        for b in range(a, n // a + 1):
            if (n // a) % b or n // a // b < b:
                continue
            c = n // a // b
            if best is None or c / a < best[2] / best[0]:
                best = (a, b, c)
    return tuple(t * k for t, k in zip(tile, best))


def _axis_density(n: int, w: int) -> float:
    """Fraction of (a, a') pairs on an axis of n tiles with |a - a'| <= w."""
    return sum(min(n - 1, a + w) - max(0, a - w) + 1 for a in range(n)) / (n * n)


def window_for_sparsity(grid: tuple, tile: tuple, sparsity: float, tol: float = 0.02) -> tuple:
    """The window (wt, wh, ww) in tiles for a ``window_tile_mask`` of sparsity (1 - selected fraction) near
    ``sparsity``: among the windows within ``tol`` of it the most even one (smallest max - min, a local window
    rather than a slab), then the nearest, then the smallest; with none within ``tol``, the nearest. The selected
    fraction factorises over the axes, so this is exact without building masks."""
    counts = [g // t for g, t in zip(grid, tile)]
    cands = []
    for w in itertools.product(*(range(n) for n in counts)):
        s = 1.0 - math.prod(_axis_density(n, wi) for n, wi in zip(counts, w))
        cands.append((round(abs(s - sparsity), 12), max(w) - min(w), w))
    close = [(spread, off, w) for off, spread, w in cands if off <= tol]
    return min(close)[2] if close else min(cands)[2]


def random_topk_mask(heads: int, n_tiles: int, sparsity: float, seed: int) -> torch.Tensor:
    """bool [heads, nT, nT]: per head and query tile round((1 - sparsity) * nT) (at least 1) key tiles drawn
    uniformly without replacement (torch.Generator seeded with ``seed``)."""
    keep = max(1, round((1.0 - sparsity) * n_tiles))
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(heads, n_tiles, n_tiles, generator=g).argsort(-1)[..., :keep]
    return torch.zeros(heads, n_tiles, n_tiles, dtype=torch.bool).scatter_(-1, idx, True)


def synthetic_tiles(heads: int, coords: torch.Tensor, seed: int, dim: int = 32) -> tuple:
    """(q_tiles, k_tiles) [heads, nT, dim]: per head, random Fourier features of the tile coordinates ``coords``
    [nT, 3] (wavelengths of 6-24 tiles: nearby tiles alike) plus half as much independent noise (long-range picks)."""
    g = torch.Generator().manual_seed(seed)
    freq = 2 * math.pi / (6.0 + 18.0 * torch.rand(heads, 3, dim, generator=g))
    phase = 2 * math.pi * torch.rand(heads, 1, dim, generator=g)
    smooth = torch.cos(torch.einsum("nc,hcd->hnd", coords.double(), freq.double()) + phase)
    noise = [0.5 * torch.randn(smooth.shape, generator=g, dtype=torch.double) for _ in range(2)]
    return tuple((smooth + n).float() for n in noise)


def topk_mask(heads: int, grid: tuple, tile: tuple, sparsity: float, seed: int) -> torch.Tensor:
    """bool [heads, nT, nT]: the DiT's top-k selection of round((1 - sparsity) * nT) key tiles (at least 1) on
    ``synthetic_tiles`` of the grid's tiles."""
    coords = tile_coords(grid, tile)
    keep = max(1, round((1.0 - sparsity) * coords.shape[0]))
    q_tiles, k_tiles = synthetic_tiles(heads, coords, seed)
    return topk_tile_mask(q_tiles, k_tiles, keep)


def selected_pairs(rows: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int,
                   heads: int) -> float:
    """Selected (query, key) token pairs summed over ``heads`` query heads (non-causal) of queries at ``q_pos``
    against keys at ``k_pos`` under the tile mask ``rows`` [1 or heads, T, T]; exact, at tile level."""
    t = rows.shape[-1]
    nq = torch.bincount(q_pos // block_size, minlength=t).double()
    nk = torch.bincount(k_pos // block_size, minlength=t).double()
    per = torch.einsum("hij,i,j->h", rows.double(), nq, nk)
    return float(per.sum() * (heads if rows.shape[0] == 1 else 1))


# ------------------------------------------------------------------------------------------------ kernels
def _inputs(h: int, sq: int, sk: int, d: int, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> list:
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(1, h, n, d, device=dev, dtype=dtype, generator=g) for n in (sq, sk, sk, sq)]


def dense_fns(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
              leaves: Optional[list] = None) -> Fns:
    """(forward without grad, forward + backward from ``do``) of the dense kernel ``name`` on q/k/v [B, H, S, D].
    leaves: the q/k/v leaf tensors whose ``.grad`` the forward + backward fills (default: detached copies)."""
    be = backends.get_backend(name)
    qkv = leaves if leaves is not None else [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            return be(q, k, v, causal=causal, softmax_scale=None)

    def fwd_bwd():
        for t in qkv:
            t.grad = None
        out = be(*qkv, causal=causal, softmax_scale=None)
        out.backward(do)
        return out
    return fwd, fwd_bwd


def sparse_fns(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
               rows: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int) -> tuple:
    """(fwd, fwd_bwd, mask_build_ms) of the registry's block-sparse kernel ``kernel`` (a setting of
    ``block_sparse.KERNELS``: "fa4", "flex", "cudnn_block_sparse", "math") on q against k/v at global positions
    q_pos / k_pos under the tile mask ``rows`` (already the heads q carries). A kernel with log-sum-exp (fa4,
    cudnn_block_sparse, math): its forward, then its backward from that out/lse (a ring step's calls); flex: forward,
    autograd backward. The kernel's metadata (FA4's block-sparse tensors, cuDNN's block lists, flex's BlockMask) is
    built once here, outside the timing: ``mask_build_ms``."""
    scale = q.shape[-1] ** -0.5
    kern = kernels.by_setting(kernel)
    ts = TileSlice(rows, block_size, q_pos, k_pos)
    t0 = time.perf_counter()
    kern.prepare(ts, q.shape[2], k.shape[2], False)       # the kernel's metadata, cached in the slice
    if q.is_cuda:
        torch.cuda.synchronize()
    build_ms = (time.perf_counter() - t0) * 1e3
    if kern.caps.lse:
        def fwd():
            return kern.forward(q, k, v, scale, False, ts)[0]

        def fwd_bwd():
            out, lse = kern.forward(q, k, v, scale, False, ts)
            kern.backward(do, q, k, v, out, lse, scale, False, ts)
            return out
    else:
        qkv = [x.detach().requires_grad_() for x in (q, k, v)]

        def fwd():
            with torch.no_grad():
                return kern.attention(q, k, v, False, scale, ts)

        def fwd_bwd():
            for x in qkv:
                x.grad = None
            out = kern.attention(*qkv, False, scale, ts)
            out.backward(do)
            return out
    return fwd, fwd_bwd, build_ms


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (CPU smoke rates are tiny, GPU ones large)."""
    return float(f"{x:.4g}")


LONG_MS: Optional[float] = None   # --long-ms (set by run): calls longer than this stop after 2 timed repetitions


def _time(fns: Fns, flops: float, iters: int, warmup: int, cuda: bool) -> dict:
    """First call (s), fwd and fwd+bwd medians (ms) and useful TFLOP/s (fwd: flops; fwd+bwd: 3.5 * flops). A first
    call longer than LONG_MS (compile included) leaves one warmup call."""
    fwd, fwd_bwd = fns
    timer = time_ms if cuda else wall_time_ms
    t0 = time.perf_counter()
    fwd_bwd()
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    if LONG_MS is not None and first_s * 1e3 > LONG_MS:
        warmup = min(warmup, 1)
    r = {"first_call_s": round(first_s, 3),
         "fwd_ms": timer(fwd, iters, warmup, None, long_ms=LONG_MS),
         "fwd_bwd_ms": timer(fwd_bwd, iters, warmup, None, long_ms=LONG_MS)}
    r["fwd_tflops"] = _sig(flops / r["fwd_ms"] / 1e9)
    r["fwd_bwd_tflops"] = _sig(3.5 * flops / r["fwd_bwd_ms"] / 1e9)
    return r


def _guard(row: dict, fn: Callable[[], dict], cuda: bool) -> dict:
    """``row`` updated with ``fn()``, or with ``error`` when it runs out of memory (the job goes on)."""
    try:
        row.update(fn())
    except torch.OutOfMemoryError as e:
        row["error"] = f"OutOfMemoryError: {str(e).splitlines()[0]}"
    if cuda:
        torch.cuda.empty_cache()
    return row


# ------------------------------------------------------------------------------------------------ rows
def ring_rows(bm: torch.Tensor, mask_meta: dict, s: int, h: int, d: int, p: int, args, dev, dtype) -> list:
    """The ring rows of one mask at P ranks: the plan's counts per rank and, for rank 0 and the busiest rank,
    the summed kernel time of the steps it runs (per kernel in --ring-kernels)."""
    bs, cuda = mask_meta["block_size"], dev.type == "cuda"
    kv_bytes = 2 * h * (s // p) * d * torch.finfo(dtype).bits // 8  # one rank's K and V
    plan = sparse_ring_plan(bm, world=p, seq_len=s, block_size=bs, placement=args.placement, causal=False,
                            kv_bytes=kv_bytes)
    counts = [plan.counts(r) for r in range(p)]
    pos = [positions(args.placement, r, p, s) for r in range(p)]
    busiest = max(range(p), key=lambda r: (counts[r]["steps_run"], -r))
    base = {"kind": "ring", **mask_meta, "s": s, "h": h, "p": p, "placement": args.placement,
            "counts_per_rank": counts, "busiest_rank": busiest,
            "note": "kernel time of the run steps only: no communication, no merge"}
    rows = []
    for kernel in args.ring_kernels.split(","):
        row = dict(base, kernel=kernel, ranks={})
        for r in sorted({0, busiest}):
            steps = [st for st in range(p) if plan.runs(0, r, st)]
            per = {"run_steps": steps, "run_steps_fwd_ms": 0.0, "run_steps_fwd_bwd_ms": 0.0, "useful_pairs": 0.0}

            def one_rank(r=r, steps=steps, per=per) -> dict:
                for st in steps:
                    o = plan.origin(0, r, st)
                    q, k, v, do = _inputs(h, pos[r].numel(), pos[o].numel(), d, dev, dtype, seed=st)
                    qp, kp = pos[r].to(dev), pos[o].to(dev)
                    pairs = selected_pairs(bm, pos[r], pos[o], bs, h)
                    fwd, fb, _ = sparse_fns(kernel, q, k, v, do, bm.to(dev), qp, kp, bs)
                    t = _time((fwd, fb), 4.0 * d * pairs, args.ring_iters, args.ring_warmup, cuda)
                    per["run_steps_fwd_ms"] += t["fwd_ms"]
                    per["run_steps_fwd_bwd_ms"] += t["fwd_bwd_ms"]
                    per["useful_pairs"] += pairs
                    del q, k, v, do, fwd, fb
                flops = 4.0 * d * per["useful_pairs"]
                if steps:
                    per["run_steps_fwd_tflops"] = _sig(flops / per["run_steps_fwd_ms"] / 1e9)
                    per["run_steps_fwd_bwd_tflops"] = _sig(3.5 * flops / per["run_steps_fwd_bwd_ms"] / 1e9)
                return per
            row["ranks"][str(r)] = _guard({}, one_rank, cuda)
        rows.append(row)
    return rows


DEFAULT_TILES = {64: (4, 4, 4), 128: (4, 4, 8)}
MASK_KINDS = ("random", "topk", "window")   # masks_for's kinds, in its order


def tile_for(block_size: int, args) -> tuple:
    """The tile (T, H, W tokens) of ``block_size``: --tile's entry for it, else DEFAULT_TILES."""
    sizes = [int(x) for x in str(args.block_size).split(",")]
    given = [tuple(int(x) for x in t.split(",")) for t in args.tile.split("/")] if args.tile else []
    if given and len(given) != len(sizes):
        raise SystemExit(f"--tile {args.tile} gives {len(given)} tiles for {len(sizes)} block sizes "
                         f"(--block-size {args.block_size}): one per block size, separated by '/'")
    tile = given[sizes.index(block_size)] if given else DEFAULT_TILES.get(block_size)
    if tile is None:
        raise SystemExit(f"--block-size {block_size} has no default tile: give --tile T,H,W (volume {block_size})")
    if math.prod(tile) != block_size:
        raise SystemExit(f"--tile {','.join(map(str, tile))} holds {math.prod(tile)} tokens; --block-size is "
                         f"{block_size}")
    return tile


def masks_for(s: int, h: int, args, bs: Optional[int] = None) -> list:
    """(bm, meta) for every mask kind in --masks and target sparsity in --sparsities at sequence length s, h heads
    and block size ``bs`` (default: the first of --block-size)."""
    bs = bs if bs is not None else int(str(args.block_size).split(",")[0])
    tile = tile_for(bs, args)
    n_tiles = block_sparse.num_tiles(s, bs)
    grid = grid_for(s, tile)
    out = []
    for target in (float(x) for x in args.sparsities.split(",")):
        if "random" in args.masks:
            bm = random_topk_mask(h, n_tiles, target, seed=args.seed)
            out.append((bm, {"mask": "random", "target_sparsity": target, "keep_tiles": int(bm[0, 0].sum())}))
        if "topk" in args.masks:
            bm = topk_mask(h, grid, tile, target, seed=args.seed)
            out.append((bm, {"mask": "topk", "target_sparsity": target, "grid": list(grid), "tile": list(tile),
                             "keep_tiles": int(bm[0, 0].sum())}))
        if "window" in args.masks:
            w = window_for_sparsity(grid, tile, target)
            bm = window_tile_mask(grid, tile, w)
            out.append((bm, {"mask": "window", "target_sparsity": target, "grid": list(grid), "tile": list(tile),
                             "window": list(w)}))
    for bm, meta in out:
        meta["sparsity"] = round(1.0 - float(bm.float().mean()), 4)
        meta["block_size"] = bs
    return out


def row_key(row: dict) -> tuple:
    """What identifies a row of the table (a resumed run skips the keys it has)."""
    return tuple(row.get(n) for n in ("kind", "layout", "kernel", "mask", "target_sparsity", "block_size", "s", "h",
                                      "p"))


def _ints(text: str) -> list:
    return [int(x) for x in str(text).split(",") if x.strip()]


def run(args) -> dict:
    """Every row for args; writes the JSON after every row (a run cut short keeps what it measured)."""
    global LONG_MS
    LONG_MS = args.long_ms
    t_start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    d = args.head_dim
    unknown = [k for k in args.ulysses_kernels.split(",") if k not in block_sparse.KERNELS[1:]]
    if unknown:
        raise SystemExit(f"--ulysses-kernels / --table-kernels: unknown {', '.join(unknown)} (the block-sparse "
                         f"kernels: {', '.join(block_sparse.KERNELS[1:])})")
    why = {k: kernels.by_setting(k).why_not(kernels.KernelCall(dev, dtype, d, frozenset({"tiles", "lse"})
                                                                if kernels.by_setting(k).caps.lse else
                                                                frozenset({"tiles"})))
           for k in args.ulysses_kernels.split(",")}
    ulysses_kernels = [k for k, reason in why.items() if reason is None]
    dense = [n for n in args.dense_kernels.split(",") if n in backends.available_backends()]
    skipped = [n for n in args.dense_kernels.split(",") if n not in dense]
    path = os.path.join(args.out, "bench_block_sparse.json")
    gpu = gpu_tag(cuda)
    meta = run_meta(gpu=gpu, torch=torch.__version__, git_commit=git_commit(),
                    utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    dtype=str(dtype), head_dim=d, block_sizes=_ints(args.block_size), causal=False,
                    dense_kernels=dense, dense_kernels_not_installed=skipped,
                    ulysses_kernels=ulysses_kernels,
                    ulysses_kernels_not_here={k: r for k, r in why.items() if r is not None},
                    dynamo_recompile_limit=_recompile_limit(), long_ms=args.long_ms,
                    flops="useful: 4*D*selected pairs per head (fwd); fwd+bwd 3.5x")
    doc = {"meta": meta, "rows": [], "runs": []}
    if args.resume and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        doc["rows"] = [r for r in old.get("rows", []) if "error" not in r]
        doc["runs"] = old.get("runs", [])
    doc["runs"].append(meta)
    def have_key(row: dict) -> tuple:
        """A row's key for --resume; with --retime-dense a dense row timed on another GPU does not count."""
        return row_key(row) + ((row.get("gpu", gpu),) if args.retime_dense and row["kind"] == "dense" else ())
    have = {have_key(r) for r in doc["rows"]}
    left: list = []

    def over_budget() -> bool:
        return args.budget_s is not None and time.perf_counter() - t_start > args.budget_s

    def todo(row: dict) -> bool:
        """Whether ``row`` (its key fields) is still to run; past the budget it is listed as left."""
        if have_key(dict(row, gpu=gpu)) in have:
            return False
        if over_budget():
            left.append(list(row_key(row)))
            return False
        return True

    def done(row: dict) -> None:
        row["utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        row["gpu"] = gpu
        doc["rows"].append(row)
        have.add(have_key(row))
        write_json(path, doc)
        print(json.dumps({k: v for k, v in row.items() if k != "counts_per_rank"}), flush=True)

    passes = [[k] for k in ulysses_kernels] if args.kernel_major else [ulysses_kernels]
    for pass_kernels, s, h in itertools.product(passes, _ints(args.seqlens), _ints(args.heads)):
        for p in sorted(set(_ints(args.ulysses_p))):
            hp = math.ceil(h / p)
            for name in dense:
                row = {"kind": "dense", "layout": "ulysses", "kernel": name, "s": s, "h": hp, "p": p, "sq": s, "sk": s}
                if not todo(row):
                    continue
                q, k, v, do = _inputs(hp, s, s, d, dev, dtype)
                done(_guard(row, lambda: _time(dense_fns(name, q, k, v, do, False), 4.0 * s * s * hp * d,
                                               args.iters, args.warmup, cuda), cuda))
                del q, k, v, do
        for p in sorted(set(_ints(args.ring_p))):
            for name in dense:
                row = {"kind": "dense", "layout": "ring_step", "kernel": name, "s": s, "h": h, "p": p,
                       "sq": s // p, "sk": s // p}
                if not todo(row):
                    continue
                q, k, v, do = _inputs(h, s // p, s // p, d, dev, dtype)
                done(_guard(row, lambda: _time(dense_fns(name, q, k, v, do, False), 4.0 * (s // p) ** 2 * h * d,
                                               args.iters, args.warmup, cuda), cuda))
                del q, k, v, do
        for bs in _ints(args.block_size):
            ring_ps = sorted(set(_ints(args.ring_p))) if pass_kernels == passes[0] else []
            planned = [{"kind": "ulysses", "kernel": kn, "mask": m, "target_sparsity": float(t), "block_size": bs,
                        "s": s, "h": math.ceil(h / p), "p": p}
                       for t in args.sparsities.split(",") for m in MASK_KINDS if m in args.masks
                       for p in sorted(set(_ints(args.ulysses_p))) for kn in pass_kernels]
            planned += [{"kind": "ring", "kernel": kn, "mask": m, "target_sparsity": float(t), "block_size": bs,
                         "s": s, "h": h, "p": p}
                        for t in args.sparsities.split(",") for m in MASK_KINDS if m in args.masks
                        for p in ring_ps for kn in args.ring_kernels.split(",")]
            for r in planned:   # the math kernel where its score matrix would not fit: recorded, no mask built
                if r["kind"] == "ulysses" and r["kernel"] == args.math_name and r["h"] * s * s > args.math_max_scores \
                        and todo(r):
                    done({**r, "skipped": f"h*S^2 > --math-max-scores {args.math_max_scores:g} (its score matrix)"})
            if all(row_key(r) in have for r in planned):
                continue   # nothing of this size left: its masks are not built
            for bm, meta_m in masks_for(s, h, args, bs):
                for p in sorted(set(_ints(args.ulysses_p))):
                    hp = math.ceil(h / p)
                    rows = block_sparse.head_rows(bm, slice(0, hp))
                    full = torch.arange(s)
                    pairs = selected_pairs(rows, full, full, bs, hp)
                    for kname in pass_kernels:
                        row = {"kind": "ulysses", "kernel": kname, **meta_m, "s": s, "h": hp, "p": p,
                               "useful_pairs": pairs}
                        if not todo(row):
                            continue

                        def ulysses(kname=kname, rows=rows, hp=hp, pairs=pairs, bs=bs) -> dict:
                            q, k, v, do = _inputs(hp, s, s, d, dev, dtype)
                            fwd, fb, build = sparse_fns(kname, q, k, v, do, rows.to(dev), full.to(dev), full.to(dev),
                                                        bs)
                            return {"mask_build_ms": round(build, 3), **_time((fwd, fb), 4.0 * d * pairs, args.iters,
                                                                               args.warmup, cuda)}
                        done(_guard(row, ulysses, cuda))
                for p in ring_ps:
                    probe = {"kind": "ring", **meta_m, "s": s, "h": h, "p": p}
                    if all(not todo(dict(probe, kernel=kn)) for kn in args.ring_kernels.split(",")):
                        continue
                    for row in ring_rows(bm, meta_m, s, h, d, p, args, dev, dtype):
                        if have_key(row) not in have:
                            done(row)
    doc["left"] = left
    doc["table"] = table(doc["rows"])
    write_json(path, doc)
    print(doc["table"])
    if left:
        print(f"--budget-s {args.budget_s} reached: {len(left)} rows left (run again with --resume)")
    print(f"wrote {path}")
    return doc


# the dense kernel "auto" tries first for a bf16 plain call (FA4): the reference of the table's ratio
RATIO_REF = kernels.candidates(kernels.KernelCall(torch.device("cuda"), torch.bfloat16, 128, frozenset({"plain"})))[0]


def dense_fa4_ratio(row: dict, rows: list) -> Optional[float]:
    """A Ulysses row's useful fwd+bwd TFLOP/s over the dense RATIO_REF (FA4) row of its S, H and P (the one timed on
    the same GPU where there is one, else any); None where either is missing."""
    if row["kind"] != "ulysses" or "fwd_bwd_tflops" not in row:
        return None
    dense = [r for r in rows if r["kind"] == "dense" and r.get("layout") == "ulysses" and r["kernel"] == RATIO_REF
             and (r["s"], r["h"], r["p"]) == (row["s"], row["h"], row["p"]) and "fwd_bwd_tflops" in r]
    dense.sort(key=lambda r: r.get("gpu") != row.get("gpu"))
    return round(row["fwd_bwd_tflops"] / dense[0]["fwd_bwd_tflops"], 3) if dense else None


def table(rows: list) -> str:
    """The rows as a markdown table (ring rows: one line per timed rank; Ulysses rows with their ratio to dense
    FA4's useful TFLOP/s at the same S, H, P)."""
    lines = ["| kind | kernel | mask | sparsity | tile | S | H | P | rank | steps run/skipped | KV MB sent/skipped | "
             "fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s (useful) | / dense FA4 | build ms |", "|" + "---|" * 16]

    def f(x) -> str:
        return "" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)
    for r in rows:
        kind = r["kind"] + ("/" + r["layout"] if "layout" in r else "")
        head = f"| {kind} | {r['kernel']} | {r.get('mask', 'dense')} | {r.get('sparsity', 0.0)} | " \
               f"{r.get('block_size', '')} | {r['s']} | {r['h']} | {r['p']} |"
        if r["kind"] != "ring":
            lines.append(f"{head} | | | {f(r.get('fwd_ms'))} | {f(r.get('fwd_bwd_ms'))} | "
                         f"{f(r.get('fwd_bwd_tflops', r.get('error', r.get('skipped'))))} | "
                         f"{f(dense_fa4_ratio(r, rows))} | {f(r.get('mask_build_ms'))} |")
            continue
        for rank, per in r["ranks"].items():
            c = r["counts_per_rank"][int(rank)]
            lines.append(f"{head} {rank} | {c['steps_run']}/{c['steps_skipped']} | "
                         f"{c['bytes_sent'] / 2**20:.1f}/{c['bytes_skipped'] / 2**20:.1f} | "
                         f"{f(per.get('run_steps_fwd_ms'))} | {f(per.get('run_steps_fwd_bwd_ms'))} | "
                         f"{f(per.get('run_steps_fwd_bwd_tflops', per.get('error')))} | | |")
    lines.append("ring rows: kernel time of the steps that run (summed), no communication.")
    return "\n".join(lines)


def gpu_tag(cuda: bool) -> str:
    """Which device timed a row: the GPU's name, its index on the host (CUDA_VISIBLE_DEVICES) and the start of its
    UUID (tells machines apart), or "cpu"."""
    if not cuda:
        return "cpu"
    uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", ""))[:8]
    return f"{torch.cuda.get_device_name()} #{os.environ.get('CUDA_VISIBLE_DEVICES', '0')} {uuid}".rstrip()


def merge(out: str, parts: list) -> dict:
    """One table from the JSONs of jobs that ran parts of it (``--table-kernels``) on GPUs of one host: --out's
    JSON (if any) first, then each part's rows whose key is new. A row whose key is already there (each job times
    the dense floor of its sizes) goes to ``cross_checks`` beside the kept one: the same kernel timed on two GPUs."""
    path = os.path.join(out, "bench_block_sparse.json")
    docs = []
    for d in ([out] if os.path.exists(path) else []) + list(parts):
        with open(os.path.join(d, "bench_block_sparse.json")) as f:
            docs.append(json.load(f))
    doc: dict = {"meta": docs[0]["meta"], "rows": [], "runs": [], "cross_checks": [], "left": []}
    kept: dict = {}
    for part in docs:
        doc["runs"] += part.get("runs", [])
        doc["left"] += [k for k in part.get("left", []) if tuple(k) not in kept]
        doc["cross_checks"] += part.get("cross_checks", [])
        for row in part["rows"]:
            key = row_key(row)
            if key not in kept:
                kept[key] = row
                doc["rows"].append(row)
            elif row.get("gpu") != kept[key].get("gpu") and "fwd_bwd_ms" in row and "fwd_bwd_ms" in kept[key]:
                doc["cross_checks"].append({"key": list(key), "kept": [kept[key]["gpu"], kept[key]["fwd_bwd_ms"]],
                                            "other": [row["gpu"], row["fwd_bwd_ms"]],
                                            "ratio": round(row["fwd_bwd_ms"] / kept[key]["fwd_bwd_ms"], 4)})
    doc["left"] = [k for k in doc["left"] if tuple(k) not in kept]
    doc["table"] = table(doc["rows"])
    os.makedirs(out, exist_ok=True)
    write_json(path, doc)
    print(doc["table"])
    print(f"merged {len(docs)} JSONs into {path}: {len(doc['rows'])} rows, {len(doc['cross_checks'])} cross-checks, "
          f"{len(doc['left'])} left")
    return doc


def _recompile_limit() -> Optional[int]:
    import torch._dynamo.config as dynamo_config  # noqa: PLC0415
    for name in ("recompile_limit", "cache_size_limit"):
        try:
            return int(getattr(dynamo_config, name))
        except AttributeError:
            continue
    return None


def parse(argv: Optional[list] = None) -> argparse.Namespace:
    """The tool's flags; --smoke replaces the sizes with a CPU-sized run (S=512, H=2, D=16, iters 1)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--heads", default="12", help="query heads, a list (12: wan-1.3b, 40: wan-14b)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", default="64", help="tile sizes in tokens, a list (64, 128)")
    ap.add_argument("--tile", default="", help="tokens per tile T,H,W of the masks' grid per block size, '/' between "
                    "them (volume = the block size; default 64: 4,4,4, 128: 4,4,8)")
    ap.add_argument("--sparsities", default="0.5,0.8,0.9")
    ap.add_argument("--masks", default="random,window", help="random, topk, window")
    ap.add_argument("--ulysses-p", default="1,8", help="Ulysses sizes: the local kernel runs H/P heads")
    ap.add_argument("--ring-p", default="4,8")
    ap.add_argument("--placement", default="contiguous", choices=["contiguous", "zigzag"])
    ap.add_argument("--ring-kernels", default="fa4,math", help="kernels of the ring steps (with log-sum-exp: fa4, math)")
    ap.add_argument("--ulysses-kernels", default="fa4,flex,math", help="block-sparse kernels of the Ulysses rows "
                    "(those that run here)")
    ap.add_argument("--math-max-scores", type=float, default=2.5e9, help="skip the math kernel where heads * S^2 "
                    "exceeds this (its fp32 score matrix)")
    ap.add_argument("--dense-kernels", default="cudnn,fa4", help="dense floor kernels (those installed run)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ring-iters", type=int, default=3, help="timed calls per ring step (each step is timed "
                    "alone; the math kernel at 32K local tokens takes seconds per call)")
    ap.add_argument("--ring-warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-ms", type=float, default=None, help="calls longer than this stop after 2 timed "
                    "repetitions (default: every call --iters times)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no row after this many seconds")
    ap.add_argument("--resume", action="store_true", help="keep the rows of --out's JSON, run the missing ones")
    ap.add_argument("--kernel-major", action="store_true", help="every size for the first of --ulysses-kernels, "
                    "then every size for the next (a budget cut leaves the slow kernels' rows)")
    ap.add_argument("--table", action="store_true", help="#53's kernel table: S 32768,75776,131072, H 40,5, "
                    "sparsities .5,.8,.9,.95, masks random,topk,window, block sizes 64,128, kernels fa4,flex,math "
                    "beside dense cudnn,fa4, Ulysses P=1, no ring rows, --long-ms 400, --kernel-major, math where "
                    "H*S^2 <= 6e9")
    ap.add_argument("--retime-dense", action="store_true", help="with --resume: time the dense floors again on this "
                    "GPU where the resumed rows' were timed on another (the ratios then use this GPU's)")
    ap.add_argument("--table-kernels", default="fa4,flex,math", help="with --table: the block-sparse kernels this "
                    "job runs (the others' rows can run in another job, on another GPU, joined by --merge), e.g. "
                    "cudnn_block_sparse,fa4: cuDNN's block sparsity beside FA4's at the same masks (#69)")
    ap.add_argument("--table-seqlens", default="32768,75776,131072", help="with --table: its sequence lengths "
                    "(#69's rows: 32768,75776)")
    ap.add_argument("--table-sparsities", default="0.5,0.8,0.9,0.95", help="with --table: its target sparsities "
                    "(#69's rows: 0.8,0.9,0.95)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="DIR", help="join the JSONs of these --out folders "
                    "into --out's (rows of new keys added; a dense row timed again goes to cross_checks) and exit")
    ap.add_argument("--smoke", action="store_true", help="CPU, S=512, H=2, D=16, sdpa dense, math kernels")
    ap.add_argument("--out", default="bench_block_sparse_out")
    args = ap.parse_args(argv)
    args.math_name = kernels.get(kernels.FALLBACK).setting
    if args.table:
        args.seqlens, args.heads, args.sparsities = args.table_seqlens, "40,5", args.table_sparsities
        args.masks, args.block_size, args.tile = "random,topk,window", "64,128", ""
        args.ulysses_kernels, args.dense_kernels = args.table_kernels, "cudnn,fa4"
        args.ulysses_p, args.ring_p = "1", ""
        args.long_ms = args.long_ms if args.long_ms is not None else 400.0
        args.kernel_major, args.math_max_scores = True, 6e9   # math: H=5 at 32K only (its fp32 score matrix)
    if args.smoke:
        args.seqlens, args.heads, args.head_dim, args.iters, args.warmup = "512", 2, 16, 1, 0
        args.ring_iters, args.ring_warmup = 1, 0
        args.ring_kernels, args.dense_kernels = "math", "sdpa"
        args.ulysses_kernels = args.ulysses_kernels if args.table else "math"   # --table: its kernels that run here
    return args


def main(argv: Optional[list] = None) -> dict:
    """Run the benchmark (see the module docstring); returns the JSON document."""
    args = parse(argv)
    if args.merge:
        return merge(args.out, args.merge)
    if torch.cuda.is_available() and not args.smoke:
        torch.cuda.set_device(0)
        raise_recompile_limit(64)
    return run(args)


def raise_recompile_limit(limit: int) -> Optional[int]:
    """Let torch.compile keep ``limit`` graphs per function (default 8): the compiled flex_attention meets one
    graph per (heads, length, mask head rows, grad or not) here, and past the limit dynamo silently runs it eagerly
    (scores materialised), which would time the wrong thing. Returns the limit now in force (None: no such knob)."""
    import torch._dynamo.config as dynamo_config  # noqa: PLC0415
    for name in ("recompile_limit", "cache_size_limit"):
        try:
            setattr(dynamo_config, name, max(int(getattr(dynamo_config, name)), limit))
            return int(getattr(dynamo_config, name))
        except AttributeError:
            continue
    return None


if __name__ == "__main__":
    main()
