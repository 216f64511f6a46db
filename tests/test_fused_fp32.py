"""--fused-elementwise in fp32 (issue #51 item 10): on CUDA the compiled regions' backward returned the [1, 1, d]
AdaLN modulation gradients as [d] ("CompiledFunctionBackward returned an invalid gradient at index 1 - got [1536]
but expected shape compatible with [1, 1, 1536]", wan-1.3b dims, B=1, 8190 tokens, fp32): Triton's mix-order
reduction (torch 2.10+), whose final reduce dropped keepdim. The regions now compile with it off
(``fused.compile_options``). Triton does not run here: these tests check that every region is compiled with that
option and that Inductor takes it (CPU, fp32, B=1: outputs and gradients, shapes included, equal eager to
rounding); the CUDA case (tests/gpu/cuda_fused_fp32.py, tests/gpu/test_cuda.py) runs the failing shapes."""
import shutil

import pytest
import torch

from training.video_dit import fused
from training.video_dit.fused import ElementwiseOps, compile_options

REGIONS = ("rms_norm", "ln_modulate", "layer_norm", "gated_residual", "qk_prep")


def test_inductor_regions_compile_without_mix_order_reduction(monkeypatch):
    from torch._inductor import config
    assert hasattr(config.triton, "mix_order_reduction")  # torch 2.10+: the option exists, so it must be off
    seen = []
    real = torch.compile

    def spy(fn, **kw):
        seen.append(kw)
        return real(fn, **kw)
    monkeypatch.setattr(fused.torch, "compile", spy)
    ops = ElementwiseOps("inductor")
    ops.qkv_pack(("layout",))
    assert len(seen) == len(REGIONS) + 1
    assert all(kw.get("options") == {"triton.mix_order_reduction": False} for kw in seen), seen
    assert compile_options("aot_eager") is None and compile_options(None) is None


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor's CPU code needs a C++ compiler")
def test_inductor_fp32_batch1_modulation_grads_match_eager():
    """The AdaLN pattern of a block (modulation chunks [1, 1, d] of one Linear output, B=1) through the compiled
    regions in fp32 with the options: the same shapes and values as eager."""
    torch._dynamo.reset()
    d, s = 64, 96
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(d, 6 * d)
    temb, x0, y0 = torch.randn(1, d, generator=g), torch.randn(1, s, d, generator=g), torch.randn(1, s, d, generator=g)
    results = []
    for ops in (ElementwiseOps(None), ElementwiseOps("inductor")):
        lin.zero_grad(set_to_none=True)
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        sh1, sc1, g1, sh2, sc2, g2 = lin(torch.nn.functional.silu(temb))[:, None].chunk(6, dim=-1)
        h = ops.ln_modulate(x, sc1, sh1, 1e-6)
        r = ops.gated_residual(x, g1, h * y)
        out = ops.gated_residual(r, g2, ops.ln_modulate(r, sc2, sh2, 1e-6))
        out.square().mean().backward()
        results.append((out.detach(), x.grad, y.grad, lin.weight.grad, lin.bias.grad))
    for got, ref in zip(results[1], results[0]):
        assert got.shape == ref.shape and torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
