"""--bf16-linear-weights (training/video_dit/precision.py): bf16 Linear weights with fp32 main weights compute
bf16 autocast's numbers. On CPU (bf16 autocast): the DiT's output, input gradient and every parameter gradient with
the Linear weights stored in bf16 equal the fp32-weight autocast run bit for bit (the bf16 weight gradients
converted to fp32 as Megatron's DDP does when it adds them into its zeroed fp32 main_grad). The whole step through
Megatron's optimizer runs in the CUDA suite (tests/test_cuda.py::test_dit_bf16_linear_weights_bitwise)."""
import copy

import pytest
import torch
from torch import nn

from training.video_dit import VideoDiT, preset
from training.video_dit import precision


def _inputs(cfg):
    g = torch.Generator().manual_seed(1)
    grid = (3, 4, 4)
    s = grid[0] * grid[1] * grid[2]
    return (torch.randn(2, s, cfg.patch_volume, generator=g), torch.rand(2, generator=g),
            torch.randn(2, cfg.text_len, cfg.text_dim, generator=g), torch.arange(s), grid)


def _grads(model, inputs):
    x = inputs[0].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x, *inputs[1:])
    y.float().square().mean().backward()
    return y.detach(), x.grad, {n: p.grad.float() for n, p in model.named_parameters()}


def test_bf16_linear_weights_equal_autocast_bitwise():
    cfg = preset("tiny", None)
    torch.manual_seed(0)
    ref = VideoDiT(cfg)
    with torch.no_grad():  # leave AdaLN-zero's identity start so every parameter gets a gradient
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    mine = copy.deepcopy(ref)
    originals = precision.to_bf16_linear_weights(mine)
    n_linear = sum(1 for m in mine.modules() if isinstance(m, nn.Linear))
    assert len(originals) >= n_linear and all(p.dtype == torch.bfloat16 for p in originals)
    assert any(p.dtype == torch.float32 for p in mine.parameters())  # norms and the rest stay fp32
    inputs = _inputs(cfg)
    y0, dx0, g0 = _grads(ref, inputs)
    y1, dx1, g1 = _grads(mine, inputs)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert all(g.abs().sum() > 0 for g in g0.values())
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    for p, full in originals.items():  # the fp32 values kept for the optimizer's main weights
        assert full.dtype == torch.float32 and torch.equal(full.to(torch.bfloat16), p.detach())


def test_restore_main_weights_puts_back_the_fp32_values():
    lin = nn.Linear(4, 3)
    full_w = lin.weight.detach().clone()
    originals = precision.to_bf16_linear_weights(lin)
    for p in originals:  # what Megatron's Float16 optimizer makes: main_param = bf16 param .float()
        p.main_param = p.detach().clone().float()
    assert not torch.equal(lin.weight.main_param, full_w)  # the bf16 rounding lost bits
    assert precision.restore_main_weights(originals) == 2
    assert torch.equal(lin.weight.main_param, full_w)
    lin.weight.main_param = lin.weight.main_param.view(-1)[:5]  # a distributed-optimizer shard
    with pytest.raises(ValueError, match="non-distributed"):
        precision.restore_main_weights(originals)


def test_resolve_choices():
    kw = dict(bf16=True, megatron_ddp=True, bf16_params=False, distributed_optimizer=False)
    assert precision.resolve("auto", **kw) and precision.resolve("on", **kw)
    assert not precision.resolve("off", **kw)
    assert not precision.resolve("auto", **{**kw, "megatron_ddp": False})
    assert not precision.resolve("auto", **{**kw, "distributed_optimizer": True})
    with pytest.raises(ValueError, match="--bf16-linear-weights=on needs --bf16"):
        precision.resolve("on", **{**kw, "bf16": False})
    with pytest.raises(ValueError, match="choose one of auto, on, off"):
        precision.resolve("yes", **kw)
