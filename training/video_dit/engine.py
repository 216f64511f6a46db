"""Framework-neutral training pieces: attention core, flow-matching batch, sharding, loss, logging.

Loss bookkeeping (both frameworks): the per-sample loss is the mean squared velocity error over
the sample's valid tokens and patch values. Rank r of an SP group holds some of those tokens and
computes ``loss_r`` = (its share of the sum) / (valid tokens * patch values), so the sample loss is
the SUM of loss_r over the SP group. Each rank back-propagates ``loss_r * sp_size``; the gradient
all-reduce then averages over data x sequence ranks (Megatron DDP over dp-with-cp, DeepSpeed over
sequence-data ranks), which gives the gradient of the mean sample loss over data-parallel ranks.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_sp_ext import make_attention, modes
from megatron_sp_ext.attention import kernels
from megatron_sp_ext.attention.backends import AutoBackend, get_backend, with_tile_kernel
from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.factory import SPResources
from megatron_sp_ext.sp.placement import pieces

from .faults import on_rank0
from .model import patchify
from .sparse import SPARSE_FLAG, SPARSE_KERNEL_FLAG, row_major_ids, tile_order
from .varlen import PackInfo

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def make_core(mode: str, group, *, num_heads: int, head_chunks=1, ring_variant: str = "ring",
              placement: str = "auto", ulysses_size=None, nodes=None, backend: str = "auto",
              transport: str = "nccl", source: str = "megatron", tile_setting: str = "auto"):
    """``core_of`` with the SPConfig of these settings (errors name the flags of ``source``); on one rank (group None
    or size 1) the mode is the local attention of ``backend`` (the factory's one-rank path)."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:   # one rank: every mode is the local attention; the mesh settings mean nothing here
        mode, head_chunks, placement, ulysses_size, nodes, transport = "ulysses", 1, "auto", None, None, "nccl"
    cfg = SPConfig(mode=mode, head_chunks=modes.head_chunks_of(mode, head_chunks), ring_variant=ring_variant,
                   arrangement=placement, ulysses_size=ulysses_size, nodes=nodes, backend=backend,
                   transport=transport, source=source)
    return core_of(cfg, group, num_heads=num_heads, tile_setting=tile_setting)


def core_of(cfg: SPConfig, group, *, num_heads: int, tile_setting: str = "auto"):
    """The DiT's attention core(q, k, v, kv_valid_len) on [B, S_local, H, D] shards (contiguous token placement)
    for ``cfg`` (its mode, chunks, backend, ...; errors name the settings of ``cfg.source``) over ``group`` (None or
    size 1: the factory's one-rank path): the factory's attention (megatron_sp_ext.make_attention), with
    its ``packed`` entry (Ulysses / HCMS) and ``attention``. The one core family of both entries (Megatron and
    DeepSpeed). The DiT has no attention dropout (its attention is dropout-free). Sparse steps call
    core(q, k, v, kv_valid_len, block_mask=, block_size=) (model.AttentionCore), their block-sparse calls on
    ``tile_setting`` (--sparse-attention-kernel; "auto": the backend's choice); ``core.group`` is ``group`` (None on
    one rank)."""
    world = dist.get_world_size(group) if group is not None else 1
    backend_setting = cfg.name("backend")
    local = with_tile_kernel(cfg.backend, tile_setting, SPARSE_KERNEL_FLAG, backend_setting)  # "auto": the backend
    # the resources (streams, auto's policies) made here: one place a test can hand in policies with its own timers;
    # one rank: the factory's one-rank path (the same kernels, the same problems per forward)
    attn = make_attention(cfg, group if world > 1 else None, num_heads=num_heads, layout="bshd",
                          placement="contiguous", backend=local, resources=SPResources(cfg))

    step: dict = {"problems": None}   # this forward's AttentionProblems (begin_step), None before the first

    def problem_of(n, cu_seqlens, block_mask, block_size, agreed: bool):
        """The forward's problem of these settings: built at its first layer (agreed across ranks there), reused by
        the others and by a checkpoint's recompute. Keyed on values every rank of the forward passes alike; a
        block mask by its object (held by the memo until the next forward): a window mask shared by the layers is
        compared once, a top-k mask per layer is declared agreed (``agreed``: no collective)."""
        memo = step["problems"]
        if memo is None:   # no forward began (a direct call): one problem per call
            base = attn.problem(kv_valid_len=n, cu_seqlens=cu_seqlens)
            return base if block_mask is None else base.with_mask(block_mask, tile=block_size, agreed=agreed)
        key = (n, None if cu_seqlens is None else id(cu_seqlens))
        if key not in memo:
            memo[key] = (attn.problem(kv_valid_len=n, cu_seqlens=cu_seqlens), cu_seqlens)
        base = memo[key][0]
        if block_mask is None:
            return base
        if agreed:
            return base.with_mask(block_mask, tile=block_size, agreed=True)
        return base.cached(("mask", id(block_mask), block_size), lambda: base.with_mask(block_mask, tile=block_size))

    def core(q, k, v, n=None, cu_seqlens=None, block_mask=None, block_size=None, mask_agreed=False):
        if block_mask is not None and cu_seqlens is not None:   # --sparse-attention tiles: one mask per sequence
            raise SPConfigError(f"--pack-samples cannot run {SPARSE_FLAG} tiles (one block mask per sequence)")
        problem = problem_of(n, cu_seqlens, block_mask, block_size, mask_agreed)
        if cu_seqlens is None:
            return attn(q, k, v, problem)
        try:  # packed samples (--pack-samples): the factory runs them per sample or refuses the mode by name
            return attn(q, k, v, problem)
        except SPConfigError as e:
            raise SPConfigError(f"--pack-samples: {e}") from None

    def begin_step() -> None:
        """A new forward: its problems are built afresh (called by the model's forward on every rank)."""
        step["problems"] = {}
    core.begin_step = begin_step
    core.takes_agreed_masks = True

    def problem_for(n):
        """The forward's problem of the packed q|k|v entry (its own: agreed for the packed buffers' shapes)."""
        memo = step["problems"]
        if memo is None:
            return attn.problem(kv_valid_len=n)
        if ("packed", n) not in memo:
            memo[("packed", n)] = (attn.problem(kv_valid_len=n), None)
        return memo[("packed", n)][0]
    core.problem_for = problem_for
    core.attention = attn
    core.group = group if world > 1 else None
    core.mode_policy = attn.res.mode_policy
    if attn.packed is not None:
        core.packed = attn.packed
    return core


def _rng(seed: int, sample: int) -> torch.Generator:
    """The noise of global sample ``sample`` (its index in the run's sample stream): the same whatever the
    data-parallel size and micro-batch split, so a run resharded across DP sizes draws what it would have."""
    return torch.Generator().manual_seed(seed * 1_000_003 + sample)


def sample_noise(shape, seed: int, index: int) -> tuple:
    """(eps of ``shape``, t [1]) of global sample ``index``: its flow-matching noise and timestep (logit-normal)."""
    g = _rng(seed, index)
    eps = torch.randn(shape, generator=g)
    return eps, torch.sigmoid(torch.randn(1, generator=g))


def describe_samples(dataset, ids: list) -> list:
    """Sample ids -> names a user can find: the file for on-disk shards, else 'synthetic sample i'."""
    files = getattr(dataset, "files", None)
    if files:
        return [files[i % len(files)] for i in ids]
    return [f"synthetic sample {i}" for i in ids]


def flow_matching_batch(dataset, step: int, seed: int, dp_rank: int, dp_world: int, micro_batch: int,
                        patch: tuple, base: int = 0, tile: Optional[tuple] = None) -> dict:
    """Rectified flow: x_t = (1 - t) x0 + t eps, target v = eps - x0, t ~ logit-normal(0, 1).

    A pure function of (step, dp_rank, base): every SP rank of a DP rank builds the same full batch, and
    a resumed run draws exactly what an uninterrupted one would. Returns full-sequence patches.
    ``tile`` (--sparse-tile, with --sparse-attention tiles): the patches and targets in tile order
    (``sparse.tile_order``; sharding then keeps neighbouring tiles on one rank) and ``order`` [N], the row-major
    id of each position (``prepare`` turns positions into the token ids RoPE reads).
    """
    xs, tgts, ts, texts, ids = [], [], [], [], []
    for m in range(micro_batch):
        index = base + (step * dp_world + dp_rank) * micro_batch + m
        sample = dataset[index]
        ids.append(index)
        x0 = sample["latent"][None]
        eps, t = sample_noise(x0.shape, seed, index)
        xs.append((1 - t) * x0 + t * eps)
        tgts.append(eps - x0)
        ts.append(t)
        texts.append(sample["text"][None])
    if len({x.shape for x in xs}) != 1 or len({tx.shape for tx in texts}) != 1:
        shapes = [f"{name}: latent {list(x.shape[1:])}, text {list(tx.shape[1:])}"
                  for name, x, tx in zip(describe_samples(dataset, ids), xs, texts)]
        raise ValueError(f"--micro-batch-size={micro_batch}: the samples of one micro-batch must have equal latent "
                         f"and text shapes ({'; '.join(shapes)}); use --micro-batch-size 1 with variable shapes")
    def cat(parts):  # one micro-sample: no copy (same values)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    x, tgt = cat(xs), cat(tgts)
    _, c, tn, h, w = x.shape
    pt, ph, pw = patch
    grid = (tn // pt, h // ph, w // pw)
    batch = {"x": patchify(x, patch), "target": patchify(tgt, patch), "t": cat(ts), "text": cat(texts), "grid": grid}
    if tile is not None:
        order, _ = tile_order(grid, tuple(tile))
        batch.update(x=batch["x"][:, order], target=batch["target"][:, order], order=order)
    return batch


def shard_tokens(full: torch.Tensor, n_valid: int, sp_rank: int, sp_world: int, placement: str = "contiguous"):
    """Pad [B, N, P] to what the placement needs and keep this rank's tokens.
    Returns (local [B, S_loc, P], token_ids [S_loc], padded length)."""
    from megatron_sp_ext.sp.placement import divisor  # noqa: PLC0415
    div = divisor(placement, sp_world)
    n_pad = -(-n_valid // div) * div
    if n_pad > n_valid:
        full = torch.cat([full, full.new_zeros(full.shape[0], n_pad - n_valid, full.shape[2])], dim=1)
    ids = torch.cat([torch.arange(a, a + n) for a, n in pieces(placement, sp_rank, sp_world, n_pad)])
    if torch.equal(ids, torch.arange(full.shape[1])):   # every token in order (one SP rank): no copy
        return full, ids, n_pad
    return full[:, ids], ids, n_pad


@dataclass
class StepInputs:
    x: torch.Tensor          # [B, S_loc, P] noisy patches of this rank
    target: torch.Tensor     # [B, S_loc, P]
    valid: torch.Tensor      # [S_loc] bool, False on padding
    t: torch.Tensor
    text: torch.Tensor
    token_ids: torch.Tensor
    grid: tuple
    n_valid: int
    n_pad: int
    pack: Optional[PackInfo] = None  # a packed step (--pack-samples): B=1, t [N], text [1, sum L_i, D]


def token_ids_of(batch: dict, positions: torch.Tensor) -> torch.Tensor:
    """The token ids (row-major grid index, what RoPE reads) of a shard's ``positions`` in ``batch``'s sequence:
    the positions themselves, or through ``batch["order"]`` for a tile-ordered batch (padding keeps its position)."""
    order = batch.get("order")
    return positions if order is None else row_major_ids(positions, order)


def prepare(batch: dict, sp_rank: int, sp_world: int, device) -> StepInputs:
    n_valid = batch["x"].shape[1]
    x, ids, n_pad = shard_tokens(batch["x"], n_valid, sp_rank, sp_world)
    tgt, _, _ = shard_tokens(batch["target"], n_valid, sp_rank, sp_world)
    return StepInputs(x.to(device), tgt.to(device), (ids < n_valid).to(device), batch["t"].to(device),
                      batch["text"].to(device), token_ids_of(batch, ids), batch["grid"], n_valid, n_pad)


def local_loss(model, inp: StepInputs, autocast_dtype=None) -> torch.Tensor:
    """This rank's share loss_r (see module docstring); padded tokens are excluded. A packed step
    (``inp.pack``): each token weighted 1 / (N * n_i) (varlen.token_weights), so the SP group's sum is the
    mean over the N samples of each sample's mean loss."""
    if inp.pack is not None:
        with torch.autocast(device_type=inp.x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            pred = model(inp.x, inp.t, inp.text, inp.token_ids, inp.grid, pack=inp.pack)
        acc = torch.promote_types(pred.dtype, torch.float32)  # float32, or float64 in float64 runs
        err = (pred.to(acc) - inp.target.to(acc)).pow(2).sum(-1)[0]  # [S_loc]
        return (err * inp.pack.token_weight).sum() / inp.x.shape[2]
    with torch.autocast(device_type=inp.x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        pred = model(inp.x, inp.t, inp.text, inp.token_ids, inp.grid,
                     kv_valid_len=inp.n_valid if inp.n_pad > inp.n_valid else None)
    err = (pred.float() - inp.target.float()).pow(2) * inp.valid[None, :, None]
    return err.sum() / (inp.n_valid * inp.x.shape[2] * inp.x.shape[0])


def sample_loss(loss_r: torch.Tensor, sp_group, dp_group) -> float:
    """Mean over DP ranks of the per-sample loss (sum of loss_r over the SP group)."""
    t = loss_r.detach().float().clone()
    if sp_group is not None and dist.get_world_size(sp_group) > 1:
        dist.all_reduce(t, group=sp_group)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(t, group=dp_group)
        t /= dist.get_world_size(dp_group)
    return float(t.item())


def attention_kernel_line(backend: str, setting: str, device: torch.device, dtype: torch.dtype,
                          head_dim: int, tile_setting: Optional[str] = None,
                          tile_setting_name: Optional[str] = None) -> str:
    """One line for the user, printed before training starts: which kernel runs the self-attention on
    ``device``/``dtype`` at ``head_dim`` and the ``setting`` (flag or JSON key) that changes it. Dense runs: the
    local-attention ``backend``'s kernel. ``tile_setting`` (the block-sparse kernel of a --sparse-attention tiles
    run: a setting of attention/block_sparse.KERNELS, "auto" resolved for ``device``/``dtype`` by the registry): it runs
    the self-attention (changed by ``tile_setting_name``, --sparse-attention-kernel where the entry has it; None: the
    entry has no such setting, the line says the kernel is the registry's pick) and the backend's kernel runs the
    cross-attention."""
    be = get_backend(backend, setting)
    if isinstance(be, AutoBackend):
        k = be.kernel_for(torch.empty(1, 1, 1, head_dim, device=device, dtype=dtype))
        dense = kernels.label(k)
    else:
        dense = be.name
    on = f"on {device.type}/{str(dtype).replace('torch.', '')}"
    if tile_setting is None:
        return f"attention kernel: {dense} {on}; change with {setting}"
    from megatron_sp_ext.attention.block_sparse import resolve_kernel  # noqa: PLC0415
    tile_kernel = resolve_kernel(tile_setting, device, dtype, setting=tile_setting_name or "tile_setting")
    how = (f"change with {tile_setting_name}" if tile_setting_name else
           "picked per call for the device and dtype (no setting of this entry changes it)")
    return (f"attention kernel: self-attention: block-sparse {kernels.by_setting(tile_kernel).label} {on}, {how}; "
            f"cross-attention: {dense}, change with {setting}")


class MetricsLog:
    """JSONL metrics, a tqdm progress bar and a loss-curve PNG (rank 0 writes)."""

    def __init__(self, log_dir: Optional[str], total_steps: int, enabled: bool, cfg=None, device="cpu",
                 start_step: int = 0, show: bool = True, group: Optional[dist.ProcessGroup] = None) -> None:
        """enabled: this rank writes (rank 0 of ``group``); show: also a progress bar. ``group``: the ranks that build
        this log together (every rank of it must): opening metrics.jsonl and plotting in ``close`` then go through
        ``faults.on_rank0``, so a failure there (an unwritable --log-dir, a full disk) ends every rank instead of
        leaving the others in the next step's collectives. None: this rank alone (no collective)."""
        self.enabled, self.log_dir, self.cfg, self.device = enabled, log_dir, cfg, torch.device(device)
        self.group = group
        self.start_step = start_step
        self.rows: list = []
        self.peak = None
        if self.device.type == "cuda":  # read the device name once, not every step
            name = torch.cuda.get_device_name(self.device)
            self.peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        self.bar = None
        self.f = None
        if log_dir:
            self._on_writer(f"--log-dir {log_dir}: opening metrics.jsonl", self._open)
        if enabled and show:
            try:
                from tqdm import tqdm  # noqa: PLC0415
                self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
            except ImportError:
                self.bar = None
        self.t0 = time.perf_counter()

    def step(self, step: int, loss: float, tokens: int, seqlen: int, extra: Optional[dict] = None) -> dict:
        now = time.perf_counter()
        dt, self.t0 = now - self.t0, now
        row = {"step": step, "loss": loss, "step_time_s": dt, "tokens_per_s": tokens / max(dt, 1e-9)}
        if self.device.type == "cuda" and self.cfg is not None:
            if self.peak:
                world = dist.get_world_size() if dist.is_initialized() else 1
                flops = self.cfg.flops_per_token(seqlen, self.cfg.text_len)
                row["mfu"] = flops * row["tokens_per_s"] / (self.peak * world)
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row.update(extra or {})
        return self.write(row)

    def write(self, row: dict) -> dict:
        """Append one finished row (metrics.jsonl on the writing rank, progress bar)."""
        self.rows.append(row)
        loss = row.get("loss")
        if self.enabled:
            if self.f:
                self.f.write(json.dumps(row) + "\n")
                self.f.flush()
            if self.bar is not None:
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{loss:.4f}" if loss is not None else "n/a")
        return row

    def close(self, title: str = "") -> Optional[str]:
        """Close the bar and file; write loss.png (rank 0). Returns its path (on every rank of the group) or None."""
        if self.bar is not None:
            self.bar.close()
        if self.f:
            self.f.close()
        if not self.log_dir:   # the same on every rank of the group (rows need not be)
            return None
        return self._on_writer(f"--log-dir {self.log_dir}: plotting loss.png",
                               lambda: plot_metrics(self.log_dir, title) if self.enabled and self.rows else None)

    def _open(self) -> None:
        if self.enabled:
            os.makedirs(self.log_dir, exist_ok=True)
            self.f = open(os.path.join(self.log_dir, "metrics.jsonl"), "a" if self.start_step > 0 else "w")

    def _on_writer(self, what: str, fn):
        """``fn()`` on this rank alone, or through ``on_rank0`` over the log's group (its writer is rank 0 there)."""
        return fn() if self.group is None else on_rank0(what, fn, self.group)


def plot_metrics(log_dir: str, title: str = "", out_dir: Optional[str] = None) -> Optional[str]:
    """loss.png and step_time.png of ``log_dir``/metrics.jsonl, written to ``out_dir`` (default ``log_dir``). Returns
    loss.png's path, or None without matplotlib or rows."""
    out_dir = out_dir or log_dir
    path = os.path.join(out_dir, "loss.png")
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        rows = []
        metrics = os.path.join(log_dir, "metrics.jsonl")
        if os.path.isfile(metrics):
            with open(metrics) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        if not rows:
            return None
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["step"] for r in rows], [r["loss"] if r["loss"] is not None else float("nan") for r in rows],
                marker=".")
        ax.set_xlabel("step")
        ax.set_ylabel("flow-matching loss")
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 3.5))  # step time beside it (step_time.png)
        ax.plot([r["step"] for r in rows], [1e3 * r["step_time_s"] for r in rows], marker=".")
        ax.set_xlabel("step")
        ax.set_ylabel("step time (ms)")
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "step_time.png"), dpi=100)
        plt.close(fig)
    except ImportError:
        return None
    return path


def seqlen_of(cfg, frames: int, height: int, width: int) -> int:
    pt, ph, pw = cfg.patch
    return (frames // pt) * (height // ph) * (width // pw)


def check_divisible(cfg, frames, height, width, sizes=None) -> None:
    """frames: frame counts; (height, width), or ``sizes`` a list of (H, W): each a multiple of the patch."""
    pt, ph, pw = cfg.patch
    for h, w in sizes or [(height, width)]:
        for n, p, name in ((h, ph, "height"), (w, pw, "width")):
            if n % p:
                raise ValueError(f"latent {name} {n} is not a multiple of the patch size {p}")
    for f in frames:
        if f % pt:
            raise ValueError(f"frame count {f} is not a multiple of the temporal patch {pt}")
