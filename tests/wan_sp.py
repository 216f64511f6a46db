"""Shared by the diffusers client's tests (tests/test_diffusers_wan.py, tests/gpu/cuda_diffusers.py): a tiny diffusers
WanTransformer3DModel, its inputs (T2V, I2V, TI2V), a test-only SparseAttentionPlan (a fixed random token order and
block mask, and a gated extra branch attached to every attn1), the masked reference processor that computes the same
attention densely in raster order, and one forward/backward whose gradients are summed over the SP group.

Gradients: every rank computes the same loss on the gathered output (``(out * weight).sum()``); each parameter's
gradient (and the latent's) is all-reduced SUM over the SP group, as docs/diffusers.md tells users to.
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
I2V = dict(image_dim=24, added_kv_proj_dim=64)   # Wan 2.1 I2V: 257 image tokens before 512 text tokens
VACE = dict(vace_layers=[0, 1], vace_in_channels=8)   # WanVACETransformer3DModel: a control video beside the latent
LATENT = (1, 4, 3, 8, 8)                          # -> 3 x 4 x 4 = 48 tokens
TEXT_LEN = {"t2v": 7, "ti2v": 7, "i2v": 512, "vace": 7}      # WanAttnProcessor splits I2V's context at 512 text tokens


def tiny_wan(kind: str = "t2v", *, seed: int = 0, dtype=torch.float64, device="cpu", **over):
    """A tiny WanTransformer3DModel (``kind`` "i2v" adds the image branch; "vace": a WanVACETransformer3DModel),
    seeded, in ``dtype`` on ``device``."""
    from diffusers import WanTransformer3DModel, WanVACETransformer3DModel  # noqa: PLC0415
    torch.manual_seed(seed)
    cfg = {**TINY, **(I2V if kind == "i2v" else {}), **(VACE if kind == "vace" else {}), **over}
    if kind == "i2v":   # the image branch's k/v projections read the image embedder's output: the model's width
        cfg["added_kv_proj_dim"] = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    cls = WanVACETransformer3DModel if kind == "vace" else WanTransformer3DModel
    model = cls(**cfg).to(device=device, dtype=dtype)
    with torch.no_grad():   # waken the zero-initialised parts so every parameter's gradient counts
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p))
    return model


def wan_inputs(kind: str = "t2v", *, seed: int = 0, dtype=torch.float64, device="cpu", latent=LATENT) -> dict:
    """The model's keyword inputs: hidden_states [B, C, F, H, W] (requires grad), timestep ([B], or [B, S] per
    token for "ti2v"), encoder_hidden_states [B, L, text_dim], and for "i2v" encoder_hidden_states_image."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    b = latent[0]
    out = {"hidden_states": r(*latent).requires_grad_(),
           "encoder_hidden_states": r(b, TEXT_LEN[kind], TINY["text_dim"])}
    t_dtype = torch.float64 if dtype == torch.float64 else torch.float32   # as pipelines pass it (bf16 rounds 417)
    if kind == "ti2v":
        s = latent[2] * (latent[3] // 2) * (latent[4] // 2)
        out["timestep"] = torch.randint(0, 1000, (b, s), generator=g).to(device=device, dtype=t_dtype)
    else:
        out["timestep"] = torch.tensor([417.0] * b, device=device, dtype=t_dtype)
    if kind == "i2v":
        out["encoder_hidden_states_image"] = r(b, 257, I2V["image_dim"])
    if kind == "vace":
        out["control_hidden_states"] = r(b, VACE["vace_in_channels"], *latent[2:])
    return out


def output_weight(inputs: dict, seed: int = 5) -> torch.Tensor:
    """A fixed random weight of the output's shape: loss = (out * weight).sum() reaches every output element."""
    x = inputs["hidden_states"]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.device)


def forward_backward(model, inputs: dict, group: Optional[dist.ProcessGroup]):
    """(output, {name: grad}) of loss = (out * weight).sum(): the parameters' and the latent's ("input")
    gradients, all-reduced SUM over ``group`` (None: one rank); a parameter without gradient counts as zeros."""
    model.zero_grad(set_to_none=True)
    inp = {k: (v.detach().clone().requires_grad_() if k == "hidden_states" else v) for k, v in inputs.items()}
    out = model(**inp).sample
    (out.double() * output_weight(inputs)).sum().backward()   # float64 loss; d loss / d out = weight in out's dtype
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for n, p in model.named_parameters()}
    grads["input"] = inp["hidden_states"].grad.detach().clone()
    if group is not None:
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return out.detach(), grads


class FixedSparsePlan:
    """A test-only SparseAttentionPlan: token order = a fixed random permutation per grid; block mask = a fixed
    random [H, T, T] per (layer, grid) (diagonal kept); extra = a per-block Linear over the head dim applied to v
    (``gated``), attached to every attn1 as ``sparse_test_gate``. One plan per model (it keeps the model's gates)."""

    def __init__(self, block_size: int = 8, *, seed: int = 11, gated: bool = True, density: float = 0.5,
                 masked: bool = True) -> None:
        self.block_size, self.seed, self.gated, self.density, self.masked = block_size, seed, gated, density, masked
        self.gates: list = []

    def token_order(self, grid_thw, device):
        s = math.prod(grid_thw)
        return torch.randperm(s, generator=torch.Generator().manual_seed(self.seed + s)).to(device)

    def block_mask(self, layer_index: int, grid_thw, heads: int) -> torch.Tensor:
        t = -(-math.prod(grid_thw) // self.block_size)
        g = torch.Generator().manual_seed(self.seed * 1000 + layer_index)
        return (torch.rand(heads, t, t, generator=g) < self.density) | torch.eye(t, dtype=torch.bool)

    def attach(self, model) -> None:
        self.gates = []
        for i, blk in enumerate(model.blocks):
            p = next(blk.attn1.parameters())
            d = blk.attn1.inner_dim // blk.attn1.heads
            lin = torch.nn.Linear(d, d)
            with torch.no_grad():
                g = torch.Generator().manual_seed(self.seed + 100 + i)
                lin.weight.copy_(0.3 * torch.randn(d, d, generator=g))
                lin.bias.copy_(0.1 * torch.randn(d, generator=g))
            lin.to(device=p.device, dtype=p.dtype)
            blk.attn1.add_module("sparse_test_gate", lin)
            self.gates.append(lin)

    def detach(self, model) -> None:
        for blk in model.blocks:
            del blk.attn1.sparse_test_gate
        self.gates = []

    def __call__(self, layer_index, q_bshd, k_bshd, v_bshd, grid_thw, group):
        mask = self.block_mask(layer_index, grid_thw, q_bshd.shape[2]).to(q_bshd.device) if self.masked else None
        extra = self.gates[layer_index](v_bshd) if self.gated else None
        return mask, extra


class MaskedReferenceProcessor:
    """diffusers' WanAttnProcessor self-attention with ``plan``'s block mask and extra applied densely in raster
    order (SDPA with a token mask [H, S, S]): the reference of a parallelized model with ``plan``."""

    def __init__(self, plan: FixedSparsePlan, layer_index: int, grid_thw) -> None:
        self.plan, self.layer_index, self.grid_thw = plan, layer_index, tuple(grid_thw)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from megatron_sp_ext.diffusers.rope import wan_rotary_eager as wan_rotary  # noqa: PLC0415 - the same formula as diffusers'
        if attn.fused_projections:
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        q, k = wan_rotary(q, *rotary_emb), wan_rotary(k, *rotary_emb)
        mask, extra = self.plan(self.layer_index, q, k, v, self.grid_thw, None)
        if mask is not None:
            order = self.plan.token_order(self.grid_thw, q.device)
            place = torch.empty_like(order)
            place[order] = torch.arange(order.numel(), device=q.device)   # raster token -> position in tile order
            tile = place // self.plan.block_size
            mask = mask[:, tile][:, :, tile]                               # [H, S, S] in raster order
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask).transpose(1, 2)
        if extra is not None:
            out = out + extra
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def reference_with_plan(model, plan: FixedSparsePlan, grid_thw):
    """A copy of the stock ``model`` with ``plan`` attached and every attn1 on ``MaskedReferenceProcessor``."""
    ref = copy.deepcopy(model)
    plan.attach(ref)
    for i, blk in enumerate(ref.blocks):
        blk.attn1.set_processor(MaskedReferenceProcessor(plan, i, grid_thw))
    return ref


def grid_of(latent=LATENT, patch=TINY["patch_size"]) -> tuple:
    return tuple(n // p for n, p in zip(latent[2:], patch))


def keep_float64() -> None:
    """Make ``Tensor.float()`` leave float64 tensors as they are (this process, for good: call it in a forked rank):
    diffusers' Wan computes its norms and modulation in float32 on purpose (``.float()``), which would round a float64
    run's sums there; with this, a float64 model is float64 throughout, so SP and SP=1 gradients can be held to 1e-10
    everywhere (tests/test_diffusers_wan.py instead holds those parameters to a float32 tolerance)."""
    original = torch.Tensor.float
    if getattr(original, "_keeps_float64", False):
        return

    def float_keeping_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)
    float_keeping_float64._keeps_float64 = True
    torch.Tensor.float = float_keeping_float64
