"""CUDA-suite worker: the DiT under FSDP2 (--use-torch-fsdp2's ``sharding.shard_model``) against the unsharded DiT.

``fsdp2_model_family(rank, world)``: the tiny DiT (random AdaLN modulation, so timesteps and every block count),
each rank one batch of its own (FSDP2 shards over all ``world`` ranks, data parallel: gradients averaged), one
forward+backward under bf16 autocast, as the entry runs it: FSDP2 with bf16 compute weights and fp32 reduction vs
the unsharded model under the same autocast on every rank's batch (loss of this rank, every parameter's gradient
averaged over the ranks). Token ids stay on the host, as the entry passes them: on CUDA FSDP2's root moves them to
the GPU (issue #52: RoPE then mixed devices). Cases: plain and --recompute-granularity full, with 2 x 3 x 5 and
3 x 5 x 7 token grids (the second not divisible by the ranks' count of anything); records as in
tests/gpu/cuda_suite.py (bf16 tolerance), family "fsdp2". ``fsdp2_entry_losses``: the entry's bf16 losses with and
without --use-torch-fsdp2. SPX_SUITE_DEVICE=cpu runs the model family on gloo (CPU autocast bf16).
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from tests.reference import TOL, rel_diff, rel_err
from tests.dit_models import modulated_dit
from training.video_dit import VideoDiT
from training.video_dit.config import DiTConfig
from training.video_dit.sharding import shard_model

DEV = os.environ.get("SPX_SUITE_DEVICE", "cuda")
# tiny widths, heads of 16 (bf16 attention on every kernel), 2 blocks
CFG = DiTConfig(dim=128, heads=8, ffn=256, layers=2, in_channels=4, text_dim=32, text_len=8, freq_dim=32)
GRIDS = [(2, 3, 5), (3, 5, 7)]
ENTRY_ARGS = ["--model", "tiny", "--frames", "4", "--latent-size", "8x12", "--quiet",
              "--lr", "1e-3", "--seed", "3", "--fused-elementwise", "off", "--num-workers", "0", "--bf16"]


def _device() -> torch.device:
    if DEV == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _model(device: torch.device, recompute: bool) -> VideoDiT:
    model = modulated_dit(CFG, seed=11, device=device)
    model.set_recompute("full" if recompute else None)
    return model


def _batch(grid: tuple, seed: int, device: torch.device) -> tuple:
    """(patches [1, S, P], t [1], text [1, L, text_dim], token_ids [S] on the HOST, target [1, S, P])."""
    g = torch.Generator().manual_seed(seed)
    s = grid[0] * grid[1] * grid[2]
    x = torch.randn(1, s, CFG.patch_volume, generator=g)
    t = torch.rand(1, generator=g)
    text = torch.randn(1, CFG.text_len, CFG.text_dim, generator=g)
    target = torch.randn(1, s, CFG.patch_volume, generator=g)
    return x.to(device), t.to(device), text.to(device), torch.arange(s), target.to(device)


def _loss(model, batch, grid, autocast: bool) -> torch.Tensor:
    x, t, text, ids, target = batch
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        pred = model(x, t, text, ids, grid)
    return (pred.float() - target.float()).pow(2).mean()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def fsdp2_model_family(rank: int, world: int) -> list:
    device = _device()
    records = []
    for recompute in (False, True):
        for grid in GRIDS:
            ref_model = _model(device, recompute)
            model = shard_model(copy.deepcopy(ref_model), dist.group.WORLD, device, bf16=True)
            batches = [_batch(grid, 100 * r + sum(grid), device) for r in range(world)]
            loss = _loss(model, batches[rank], grid, autocast=True)
            loss.backward()
            grads = {n: _full(p.grad).detach() for n, p in model.named_parameters()}
            ref_loss = None
            for r, b in enumerate(batches):  # the unsharded model on every rank's batch: the average gradient
                lo = _loss(ref_model, b, grid, autocast=True)
                (lo / world).backward()
                ref_loss = lo.detach() if r == rank else ref_loss
            ref = dict(ref_model.named_parameters())
            errs = {"loss": rel_diff(loss.item(), ref_loss.item())}
            errs.update({f"grad {n}": rel_err(g, ref[n].grad) for n, g in grads.items()})
            records.append({"family": "fsdp2", "case": f"P={world} FSDP2 bf16 vs unsharded autocast bf16 grid={grid} "
                            f"recompute={'full' if recompute else 'none'} token ids on the host",
                            "errs": errs, "tol": TOL[torch.bfloat16]})
    return records


def fsdp2_entry_losses(rank: int, world: int, steps: int = 6) -> dict:
    """The megatron-core entry in bf16 at DP=world: {"plain": losses, "fsdp2": losses} (plain: megatron's DDP on
    CUDA, torch's elsewhere)."""
    from training import pretrain_video_dit  # noqa: PLC0415
    argv = [*ENTRY_ARGS, "--train-iters", str(steps)]
    return {"plain": pretrain_video_dit.main(argv)["losses"],
            "fsdp2": pretrain_video_dit.main([*argv, "--use-torch-fsdp2"])["losses"]}


def priority_entry_losses(rank: int, world: int, steps: int = 4) -> dict:
    """The megatron-core entry in bf16 at DP=world with and without ``--high-priority-stream-groups cp dp_cp``
    (megatron-core's NCCL stream priority): {"plain": losses, "priority": losses}."""
    from training import pretrain_video_dit  # noqa: PLC0415
    argv = [*ENTRY_ARGS, "--train-iters", str(steps)]
    return {"plain": pretrain_video_dit.main(argv)["losses"],
            "priority": pretrain_video_dit.main([*argv, "--high-priority-stream-groups", "cp", "dp_cp"])["losses"]}
