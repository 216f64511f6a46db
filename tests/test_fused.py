"""--fused-elementwise: the DiT's elementwise regions run through torch.compile (training/video_dit/fused.py).
On CPU the regions are compiled with the aot_eager backend (the same graph capture, autograd split and
partitioning as on GPU, without Triton code generation): the model's output, input grad and every parameter
grad equal the eager path bit for bit, with and without activation checkpointing and under bf16 autocast.
Inductor's generated kernels are exercised on GPU (tools/bench_train_step.py, variant "unfused" beside the
default)."""
import pytest
import torch

from training.video_dit import VideoDiT, preset
from training.video_dit.fused import resolve_fused


def _case(dtype):
    cfg = preset("tiny", None)
    torch.manual_seed(0)
    model = VideoDiT(cfg).to(dtype)
    with torch.no_grad():  # leave AdaLN-zero's identity start so every region reaches the output
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    g = torch.Generator().manual_seed(1)
    grid = (3, 4, 4)
    s = grid[0] * grid[1] * grid[2]
    patches = torch.randn(2, s, cfg.patch_volume, generator=g).to(dtype)
    t = torch.rand(2, generator=g)
    text = torch.randn(2, cfg.text_len, cfg.text_dim, generator=g).to(dtype)
    return model, (patches, t, text, torch.arange(s), grid)


def _run(model, inputs, backend, recompute=None, autocast=False):
    model.set_fused_elementwise(backend)
    model.set_recompute(recompute)
    model.zero_grad(set_to_none=True)
    x = inputs[0].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = model(x, *inputs[1:])
    (y.float().square().mean()).backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", [None, "full"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_fused_regions_equal_eager_bitwise(recompute, autocast):
    torch._dynamo.reset()
    model, inputs = _case(torch.float32)
    y0, dx0, g0 = _run(model, inputs, None, recompute, autocast)
    y1, dx1, g1 = _run(model, inputs, "aot_eager", recompute, autocast)
    assert model.blocks[0].ops.backend == "aot_eager" and model.blocks[1].cross.ops is model.ops
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert all(g.abs().sum() > 0 for g in g0.values() if g is not None)
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def test_resolve_fused_flag():
    assert resolve_fused("auto", torch.device("cpu")) is None
    assert resolve_fused("auto", torch.device("cuda", 0)) == "inductor"
    assert resolve_fused("on", torch.device("cpu")) == "inductor"
    assert resolve_fused("off", torch.device("cuda")) is None
    with pytest.raises(ValueError, match="--fused-elementwise='fast'"):
        resolve_fused("fast", torch.device("cpu"))


def test_qkv_pack_compiled_equals_eager_bitwise():
    """The packed-q|k|v producer (QK-norm + RoPE + send layout) through torch.compile equals eager bit for
    bit, outputs and the gradients of y and both norm weights; one compiled function per HeadLayout."""
    from megatron_sp_ext.sp.ulysses.packed import packed_head_layout
    from training.video_dit.fused import ElementwiseOps
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    heads, hd, b, s = 8, 16, 2, 5
    y0 = torch.randn(b, s, 3 * heads * hd, generator=g)
    wq, wk = (1 + 0.1 * torch.randn(heads * hd, generator=g) for _ in range(2))
    angles = torch.randn(s, hd // 2, generator=g, dtype=torch.float64)
    layout = packed_head_layout(heads, heads, 4, 2)
    results = []
    for ops in (ElementwiseOps(None), ElementwiseOps("aot_eager")):
        y, a, c = (t.clone().requires_grad_() for t in (y0, wq, wk))
        sends = ops.qkv_pack(layout)(y, a, c, 1e-6, 1e-6, angles, heads)
        assert ops.qkv_pack(layout) is ops.qkv_pack(layout)
        assert [tuple(t.shape) for t in sends] == [(4, s, b, 3, hd)] * 2 and all(t.is_contiguous() for t in sends)
        sum((t * torch.arange(t.numel()).view_as(t).sin()).sum() for t in sends).backward()
        results.append([t.detach() for t in sends] + [y.grad, a.grad, c.grad])
    for x, ref in zip(*results):
        assert torch.equal(x, ref)


def _curve(backend, steps: int) -> list:
    """Losses of ``steps`` AdamW steps of the tiny DiT (bf16 autocast on CPU), one fixed batch per step."""
    torch._dynamo.reset()
    model, inputs = _case(torch.float32)
    model.set_fused_elementwise(backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        target = torch.randn(inputs[0].shape, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(*inputs)
        loss = (y.float() - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_fused_loss_curve_50_steps_equals_eager(tmp_path):
    """#34: 50 training steps with the fused regions (aot_eager on CPU) give the eager loss curve bit for bit; the
    comparison goes through tools/loss_curves.py, the tool the GPU run uses for the Inductor curves."""
    import json

    from tools.loss_curves import compare
    curves = {name: _curve(be, 50) for name, be in (("eager", None), ("fused", "aot_eager"))}
    assert curves["eager"][-1] < curves["eager"][0]  # it trains
    for name, c in curves.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"step": i, "loss": v}) + "\n"
                                                        for i, v in enumerate(c)))
    res = compare(("eager", str(tmp_path / "eager.jsonl")), [("fused", str(tmp_path / "fused.jsonl"))], None,
                  str(tmp_path / "out"))
    assert res["runs"]["fused"] == {"steps": 50, "max_rel": 0.0, "mean_rel": 0.0}
    assert curves["fused"] == curves["eager"]


def test_loss_curves_tool_reports_gaps(tmp_path):
    import json

    from tools.loss_curves import compare
    for name, vals in (("a", [2.0, 1.0]), ("b", [2.0, 1.1]), ("n", [2.2, 1.0])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"step": i, "loss": v}) + "\n"
                                                        for i, v in enumerate(vals)))
    res = compare(("a", str(tmp_path / "a.jsonl")), [("b", str(tmp_path / "b.jsonl"))], ("n", str(tmp_path / "n.jsonl")),
                  str(tmp_path / "out"))
    assert abs(res["runs"]["b"]["max_rel"] - 0.1) < 1e-12 and abs(res["noise"]["max_rel"] - 0.1) < 1e-12
    assert res["runs"]["b"]["within_noise"] and (tmp_path / "out" / "loss_curves.png").exists()
