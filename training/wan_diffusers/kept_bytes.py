r"""What diffusers' Wan model keeps per video token between its forward and its backward, and the most it holds per
token during its backward, measured on the CPU from the model's own code (the memory plan's activation terms:
training/wan_diffusers/memory_plan.py).

    python -m training.wan_diffusers.kept_bytes          # re-derive; prints the tables memory_plan.py commits

How: a tiny ``WanTransformer3DModel`` (diffusers' own blocks) runs one training step's forward and backward (the
flow loss over a synthetic latent, bf16 autocast as the GPU run, the base in bf16 for LoRA as the trainer does)
under a ``TorchDispatchMode`` that records every tensor storage an op creates (a weak reference: never keeping it
alive). After the forward (autocast exited, its cast cache dropped) the storages still alive are what the step
keeps for its backward; during the backward the largest sum of live ones is the backward's peak. Only storages
whose size grows with the video tokens are counted: each is [tokens x width] for one width of the model, so its
bytes per token are element size x width, booked under that width's name (``UNITS``: dim, ffn, heads, head_dim,
the patch's channels x patch volume, the LoRA rank, or 1 for per-token statistics). The tiny model's widths differ
from one another and its token count (3 x 5 x 7 = 105) divides no weight's size, so the book-keeping is
unambiguous; a storage that grows with the tokens but matches no width is refused (a diffusers change shows up as
an error, not a silent miscount). Weight-sized storages (autocast's bf16 weight copies, gradients) are left to the
plan, which counts them from the parameters.

Recompute choices: none; full (diffusers' ``enable_gradient_checkpointing``: the checkpoint holds each block's
inputs); selective (``megatron_sp_ext.diffusers.keep_attention_checkpointing`` at SP=1: the attention's node keeps
q, k, v, out and its log-sum-exp). Measured at 1 and 2 blocks: per block = the difference, root (patch embedding,
rope, output head, loss) = 1 block's less the block's. Dtype caveat: CPU autocast casts the same matmul-like ops
to bf16 as CUDA's (linear, conv, scaled_dot_product_attention); diffusers' explicit ``.float()`` casts (residual
stream into the norms, FP32LayerNorm, the AdaLN modulation) are the same on both, so the saved dtypes match. The
attention kernel differs (CPU flash vs cuDNN / FA on the GPU): both save q, k, v, out (bf16) and an fp32 log-sum-exp
per head; the backward's transients (the peak) are the CPU kernel's.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

RECOMPUTES = ("none", "full", "selective")
UNITS = ("dim", "ffn", "heads", "head_dim", "patch_channels", "rank", "one")
# the probe model: every width distinct, none a multiple of another that could be confused, 105 tokens / 175 tokens
PROBE = dict(num_attention_heads=3, attention_head_dim=16, ffn_dim=80, in_channels=6, out_channels=6, text_dim=32,
             freq_dim=32, patch_size=(1, 2, 2), cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
             image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024, pos_embed_seq_len=None)
PROBE_RANK = 5
PROBE_GRIDS = ((3, 10, 14), (5, 10, 14))   # latent F x H x W: 105 and 175 tokens after the 1x2x2 patch
PROBE_TEXT = 8


def widths(dim: int, ffn: int, heads: int, head_dim: int, patch_channels: int, rank: int) -> dict:
    """The model's width of each unit (UNITS)."""
    return {"dim": dim, "ffn": ffn, "heads": heads, "head_dim": head_dim, "patch_channels": patch_channels,
            "rank": rank, "one": 1}


def probe_widths() -> dict:
    p = PROBE
    return widths(p["num_attention_heads"] * p["attention_head_dim"], p["ffn_dim"], p["num_attention_heads"],
                  p["attention_head_dim"], p["out_channels"] * 4, PROBE_RANK)


@dataclass(frozen=True)
class PerToken:
    """Bytes per video token as {unit: bytes per unit of its width}: sum(coef[u] x width[u])."""

    coef: tuple   # ((unit, bytes), ...) in UNITS order, zero units left out

    def bytes(self, width: dict) -> float:
        return float(sum(c * width[u] for u, c in self.coef))

    def as_dict(self) -> dict:
        return dict(self.coef)


def _per_token(book: dict) -> PerToken:
    return PerToken(tuple((u, book[u]) for u in UNITS if book.get(u)))


class _Storages(TorchDispatchMode):
    """Every storage an op creates (weakly), and the peak of the token-sized live ones since ``mark_peak``."""

    def __init__(self, tokens: int, width: dict, before: set) -> None:
        super().__init__()
        self.tokens, self.by_width, self.before = tokens, {}, before   # before: storages that existed (weights)
        for u, w in width.items():
            if w in self.by_width:
                raise ValueError(f"probe widths must differ: {u} and {self.by_width[w]} are both {w}")
            self.by_width[w] = u
        self.live: dict = {}   # storage key -> (weak ref, nbytes, unit or None)
        self.peak, self.peak_book, self.tracking_peak = 0, {}, False

    def _unit(self, t: torch.Tensor, nbytes: int) -> Optional[str]:
        numel = nbytes // t.element_size()
        if numel % self.tokens:
            return None
        unit = self.by_width.get(numel // self.tokens)
        if unit is None:
            raise ValueError(f"a {tuple(t.shape)} {t.dtype} tensor has {numel // self.tokens} elements per video "
                             f"token, a width the plan does not know ({self.by_width}): diffusers' Wan changed, "
                             f"update kept_bytes.UNITS and the plan")
        return unit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                key = s._cdata
                if key not in self.live and key not in self.before:
                    self.live[key] = (StorageWeakRef(s), s.nbytes(), self._unit(t, s.nbytes()))
        if self.tracking_peak:
            self._sweep()
            total = sum(n for _, n, u in self.live.values() if u is not None)
            if total > self.peak:
                self.peak, self.peak_book = total, self.book()
        return out

    def _sweep(self) -> None:
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            del self.live[key]

    def book(self) -> dict:
        """Bytes per token and unit of the live token-sized storages (bytes of a [tokens x width] tensor per token
        and per unit of its width: its element size)."""
        out: dict = {}
        for _, n, u in self.live.values():
            if u is not None:
                w = [w for w, name in self.by_width.items() if name == u][0]
                out[u] = out.get(u, 0) + n / (self.tokens * w)
        return out


def measure(recompute: str, lora: bool, layers: int, grid: tuple) -> tuple[dict, dict]:
    """(kept after the forward, peak during the backward) of a tiny model with ``layers`` blocks on latent
    ``grid`` (F, H, W): each {unit: bytes per token per unit of its width} (module docstring)."""
    from diffusers import WanTransformer3DModel  # noqa: PLC0415
    from training.wan_diffusers.lora import LoraSettings, add_lora, base_to_bf16  # noqa: PLC0415
    if recompute not in RECOMPUTES:
        raise ValueError(f"recompute={recompute!r}: one of {', '.join(RECOMPUTES)}")
    torch.manual_seed(0)
    model = WanTransformer3DModel(**dict(PROBE, num_layers=layers)).float()
    if lora:
        add_lora(model, LoraSettings(PROBE_RANK, float(PROBE_RANK)), seed=1)
        base_to_bf16(model)
    handle = None
    if recompute == "full":
        model.enable_gradient_checkpointing()
    elif recompute == "selective":
        from megatron_sp_ext.diffusers import keep_attention_checkpointing, parallelize  # noqa: PLC0415
        handle = parallelize(model, None)
        keep_attention_checkpointing(handle)
    f, h, w = grid
    tokens = f * (h // 2) * (w // 2)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, PROBE["in_channels"], f, h, w, generator=gen)
    target = torch.randn(x.shape, generator=gen)
    text = torch.randn(1, PROBE_TEXT, PROBE["text_dim"], generator=gen)
    mode = _Storages(tokens, probe_widths(),
                     {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers(), x, target, text]})
    try:
        with mode:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pred = model(x, torch.tensor([500.0]), text, return_dict=False)[0]
            loss = (pred.float() - target).pow(2).mean()
            del pred
            gc.collect()
            mode._sweep()
            kept = mode.book()
            mode.tracking_peak = True
            loss.backward()
    finally:
        if handle is not None:
            handle.remove()
    return kept, mode.peak_book


def _sub(a: dict, b: dict) -> dict:
    return {u: a.get(u, 0) - b.get(u, 0) for u in UNITS if a.get(u, 0) - b.get(u, 0)}


@dataclass(frozen=True)
class Derived:
    """One recompute choice's terms: block (kept per block), root (kept outside the blocks), work (one block's
    backward at its peak beyond what the other blocks keep: its own kept, recomputed tensors, gradients in flight;
    measured at one block, less the root's kept)."""

    block: PerToken
    root: PerToken
    work: PerToken


def derive(recompute: str, lora: bool) -> Derived:
    """The per-token terms of ``recompute`` (full fine-tuning or LoRA) from four probe steps: 1 and 2 blocks at
    two token counts; the per-token books of the two token counts must agree (nothing quadratic, no constant
    mistaken for a per-token part)."""
    runs = {(n, g): measure(recompute, lora, n, g) for n in (1, 2) for g in PROBE_GRIDS}
    for n in (1, 2):
        a, b = runs[(n, PROBE_GRIDS[0])], runs[(n, PROBE_GRIDS[1])]
        if _sub(a[0], b[0]) or _sub(a[1], b[1]):
            raise ValueError(f"{recompute}{' LoRA' if lora else ''}: per-token bytes differ between "
                             f"{PROBE_GRIDS[0]} and {PROBE_GRIDS[1]}: {a} vs {b}")
    (kept1, peak1), (kept2, peak2) = runs[(1, PROBE_GRIDS[0])], runs[(2, PROBE_GRIDS[0])]
    block = _sub(kept2, kept1)
    root = _sub(kept1, block)
    # one block's backward beyond the root's and the lower blocks' kept: at 1 block, and at 2 (where the peak may
    # sit in the lower block's backward, with the upper block's gradient arriving): the larger, unit by unit
    work1, work2 = _sub(peak1, root), _sub(peak2, {u: root.get(u, 0) + block.get(u, 0) for u in UNITS})
    work = {u: max(work1.get(u, 0), work2.get(u, 0)) for u in UNITS}
    return Derived(_per_token(block), _per_token(root), _per_token(work))


def derive_all() -> dict:
    """{(recompute, lora): Derived} for every recompute choice, full fine-tuning and LoRA."""
    return {(rc, lora): derive(rc, lora) for rc in RECOMPUTES for lora in (False, True)}


def main() -> int:
    for (rc, lora), d in derive_all().items():
        print(f"({rc!r}, {lora}): Derived(block=PerToken({d.block.coef}), root=PerToken({d.root.coef}), "
              f"work=PerToken({d.work.coef})),")
    return 0


if __name__ == "__main__":
    sys.exit(main())
