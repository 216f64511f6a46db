"""training/train_wan_diffusers.py's training modes on CPU (gloo, the tiny presets): full fine-tuning and LoRA of T2V,
I2V (mask + cond_latent channels, CLIP image embeddings), a TI2V-shaped model (clean first frame, per-token
timesteps, the frame left out of the loss) and one A14B-shaped expert (its timestep range, transformer_2/ of a
pipeline directory), on a prepared-format folder the test writes (latent, text, cond_latent, image_embeds,
metadata, index.jsonl); resume bit-identical (LoRA: adapters + optimizer only); --save-lora / --save-pretrained read
back by plain diffusers (load_lora_weights / load_lora_adapter / from_pretrained) with the trainer's output; at SP=2
and SP=4 (float64, diffusers' float32 casts kept float64) the LoRA and full-FT gradients equal SP=1 within 1e-10,
dense and with window / top-k tiles; --recompute-granularity selective equals full and none bit for bit; LoRA under
FSDP2; the I2V mask and condition equal diffusers' WanImageToVideoPipeline.prepare_latents; bad flags refused."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("diffusers", reason="needs diffusers (pip install 'megatron_sp_ext[diffusers]')")
pytest.importorskip("peft", reason="needs peft (pip install 'megatron_sp_ext[diffusers]')")

import torch  # noqa: E402

import torch.distributed.checkpoint.state_dict  # noqa: E402,F401  (imported once before the harness forks ranks)
import torch.distributed.fsdp  # noqa: E402,F401
import peft  # noqa: E402,F401
from diffusers import WanTransformer3DModel  # noqa: E402,F401
import megatron_sp_ext.diffusers  # noqa: E402,F401
import megatron_sp_ext.diffusers.sparse  # noqa: E402,F401
from tests.harness import run_ranks  # noqa: E402
from tests.wan_sp import keep_float64  # noqa: E402
from training import train_wan_diffusers as entry  # noqa: E402
from training.wan_diffusers import lora as wan_lora  # noqa: E402
from training.wan_diffusers import model as wan  # noqa: E402
from training.wan_diffusers import task as wan_task  # noqa: E402

BASE = ["--frames", "4", "--latent-size", "8x8", "--quiet", "--cp-comm-type", "ulysses", "--lr", "1e-3"]
TOL64 = 1e-10
SPARSE = ["--sparse-attention", "tiles", "--sparse-tile", "1,2,2"]


# ----------------------------------------------------------------------------- a prepared folder (the data contract)

def write_prepared(folder, preset: str, n: int = 3, frames: int = 4, size: int = 8, seed: int = 0) -> None:
    """``n`` samples in prepare's format for ``preset``'s model: one safetensors file each ("latent" [C, F, H, W],
    "text" [L, D] with zeros after the caption's tokens, and for I2V / TI2V "cond_latent" (first frame's latents,
    then zeros' latents: here the latent's first frame and zeros), "image_embeds" [N, D_img] where the model has an
    image branch), metadata, and index.jsonl."""
    from safetensors.torch import save_file
    kw = wan.preset_kwargs(preset)
    task, _ = wan.PRESET_TASKS[preset]
    c, text_len = kw["out_channels"], wan.TEXT_LEN.get(preset, 512)
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        latent = torch.randn(c, frames, size, size, generator=g)
        text = torch.zeros(text_len, kw["text_dim"])
        text[:5] = torch.randn(5, kw["text_dim"], generator=g)
        tensors = {"latent": latent, "text": text}
        if task != "t2v":
            cond = torch.zeros_like(latent)
            cond[:, :1] = latent[:, :1] + 0.1 * torch.randn(c, 1, size, size, generator=g)
            tensors["cond_latent"] = cond
        if kw.get("image_dim"):
            tensors["image_embeds"] = torch.randn(wan.IMAGE_TOKENS.get(preset, 257), kw["image_dim"], generator=g)
        name = f"clip_{i:03d}.safetensors"
        meta = {"caption": f"clip {i}", "source": f"videos/clip_{i}.mp4", "frames": str((frames - 1) * 4 + 1),
                "height": str(size * 8), "width": str(size * 8), "vae": f"AutoencoderKLWan z_dim={c}",
                "format": "wan-latents-v1"}
        save_file(tensors, os.path.join(folder, name), metadata=meta)
        rows.append({"file": name, "source": meta["source"], "caption": meta["caption"],
                     "latent_shape": list(latent.shape), "text_len": 5, "has_cond": "cond_latent" in tensors,
                     "has_image_embeds": "image_embeds" in tensors})
    with open(os.path.join(folder, "index.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _run(rank, world, argv, grads_at=None):
    res = entry.main(list(argv), return_params=True, grads_at=grads_at)
    return (res["losses"], {n: p.numpy() for n, p in res["params"].items()},
            {n: g.numpy() for n, g in res.get("grads", {}).items()})


def _user_error(rank, world, argv):
    from training.video_dit.faults import run_entry
    return run_entry(entry.main, entry.WHAT, list(argv))


def _equal(a, b, what):
    (la, pa, _), (lb, pb, _) = a, b
    assert la == lb, (what, la, lb)
    assert pa.keys() == pb.keys() and all((pa[n] == pb[n]).all() for n in pa), what


def _trained(params: dict, preset: str, lora=None, seed: int = 1234):
    """The trainer's model rebuilt from its returned parameters (stock diffusers, plus the adapters for LoRA)."""
    model = wan.random_model(wan.preset_kwargs(preset), seed, torch.device("cpu"))
    if lora is not None:
        wan_lora.add_lora(model, lora, seed + 1)
    model.load_state_dict({n: torch.from_numpy(p) for n, p in params.items()})
    return model.eval()


def _inputs(preset: str, seed: int = 3) -> dict:
    kw = wan.preset_kwargs(preset)
    g = torch.Generator().manual_seed(seed)
    out = {"hidden_states": torch.randn(1, kw["in_channels"], 4, 8, 8, generator=g),
           "timestep": torch.tensor([300.0]),
           "encoder_hidden_states": torch.randn(1, wan.TEXT_LEN.get(preset, 512), kw["text_dim"], generator=g)}
    if kw.get("image_dim"):
        out["encoder_hidden_states_image"] = torch.randn(1, wan.IMAGE_TOKENS[preset], kw["image_dim"], generator=g)
    return out


def _out(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


# ----------------------------------------------------------------------------- T2V: LoRA resume, save, load

def test_t2v_lora_resume_bit_identical_and_load_lora_weights(tmp_path):
    """SP=2, the prepared folder: 4 steps straight == 2 steps, save (adapters + optimizer only), resume 2 more;
    --save-lora then WanPipeline.load_lora_weights on the base model gives the trainer's output exactly."""
    data, ck, out = str(tmp_path / "data"), str(tmp_path / "ck"), str(tmp_path / "lora")
    write_prepared(data, "tiny")
    argv = [*BASE, "--model", "tiny", "--data-path", data, "--context-parallel-size", "2", "--lora-rank", "4",
            "--lora-alpha", "8"]
    straight = run_ranks(_run, 2, [*argv, "--train-iters", "4"], timeout=150)[0]
    run_ranks(_run, 2, [*argv, "--train-iters", "2", "--save", ck], timeout=150)
    rest = run_ranks(_run, 2, [*argv, "--train-iters", "4", "--load", ck, "--save-lora", out], timeout=150)[0]
    assert rest[0] == straight[0][2:], (rest[0], straight[0])
    assert all((rest[1][n] == straight[1][n]).all() for n in straight[1]), "resumed LoRA run differs"
    saved = os.path.join(ck, "iter_0000002")
    meta = torch.distributed.checkpoint.FileSystemReader(saved).read_metadata().state_dict_metadata
    assert meta and all("lora_" in k for k in meta if k.startswith("model.")), sorted(meta)[:4]
    assert any(k.startswith("optimizer.") for k in meta)
    lora = wan_lora.LoraSettings(4, 8.0)
    trained = _trained(rest[1], "tiny", lora)
    base = wan.random_model(wan.preset_kwargs("tiny"), 1234, torch.device("cpu"))
    names = trained.state_dict()
    for n, p in base.state_dict().items():   # the frozen base is the base (peft's Linear: <module>.base_layer.*)
        head, _, leaf = n.rpartition(".")
        assert torch.equal(p, names.get(f"{head}.base_layer.{leaf}", names.get(n))), f"LoRA changed {n}"
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=base)
    x = _inputs("tiny")
    before = _out(pipe.transformer, x)
    pipe.load_lora_weights(out)
    assert torch.equal(_out(pipe.transformer, x), _out(trained, x))
    assert not torch.equal(before, _out(trained, x)), "the adapters did not train"


# ----------------------------------------------------------------------------- I2V: full and LoRA, refusal

def test_i2v_full_and_lora_from_prepared_folder(tmp_path, capfd):
    data, bare, out, lora_dir = (str(tmp_path / d) for d in ("data", "bare", "out", "lora"))
    write_prepared(data, "tiny-i2v")
    write_prepared(bare, "tiny")   # T2V files: no cond_latent / image_embeds
    argv = [*BASE, "--model", "tiny-i2v", "--context-parallel-size", "2", "--train-iters", "2"]
    code = run_ranks(_user_error, 2, [*argv, "--data-path", bare], timeout=90)
    err = capfd.readouterr().err
    assert code == [1, 1] and "clip_000.safetensors" in err and "'cond_latent'" in err and "--task i2v" in err \
        and "Traceback" not in err, err
    full = run_ranks(_run, 2, [*argv, "--data-path", data, "--save-pretrained", out], timeout=150)[0]
    trained, x = _trained(full[1], "tiny-i2v"), _inputs("tiny-i2v")
    assert torch.equal(_out(wan.load_model(out, torch.device("cpu")), x), _out(trained, x))
    if wan.has_accelerate():
        assert torch.equal(_out(WanTransformer3DModel.from_pretrained(out), x), _out(trained, x))
    lora = run_ranks(_run, 2, [*argv, "--data-path", data, "--lora-rank", "2", "--save-lora", lora_dir],
                     timeout=150)[0]
    trained = _trained(lora[1], "tiny-i2v", wan_lora.LoraSettings(2, 2.0))
    stock = wan.random_model(wan.preset_kwargs("tiny-i2v"), 1234, torch.device("cpu"))
    stock.load_lora_adapter(lora_dir, prefix="transformer", weight_name="pytorch_lora_weights.safetensors")
    assert torch.equal(_out(stock, x), _out(trained, x))


def test_i2v_condition_is_the_pipelines(tmp_path):
    """task.i2v_mask + cond_latent (the contract's: the normalized latents of [first frame, zero frames]) equal
    WanImageToVideoPipeline.prepare_latents' condition (tiny random VAE); TI2V's cond_latent[:, :, :1] equals its
    expand_timesteps condition (the image alone)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    torch.manual_seed(0)
    z = 4
    vae = AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0]).eval()
    image = torch.rand(1, 3, 16, 16) * 2 - 1
    frames = 9   # -> 3 latent frames
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    with torch.no_grad():
        video = torch.cat([image[:, :, None], torch.zeros(1, 3, frames - 1, 16, 16)], dim=2)
        cond_latent = (vae.encode(video).latent_dist.mode() - mean) / std
        for expand in (False, True):
            pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae,
                                           scheduler=FlowMatchEulerDiscreteScheduler(), image_processor=None,
                                           image_encoder=None, transformer=None, expand_timesteps=expand)
            got = pipe.prepare_latents(image, 1, z, 16, 16, frames, torch.float32, torch.device("cpu"),
                                       torch.Generator().manual_seed(0))
            if expand:
                assert torch.allclose(got[1], cond_latent[:, :, :1], atol=1e-6)
                batch = {"x": torch.randn(got[0].shape), "t": torch.tensor([0.3]), "text": torch.zeros(1, 4, 8),
                         "cond": cond_latent}
                inputs, keep = wan_task.model_inputs(wan_task.WanTask("ti2v"), batch, (1, 2, 2))
                want = (1 - got[2]) * got[1] + got[2] * batch["x"]
                assert torch.allclose(inputs["hidden_states"], want, atol=1e-6)
                ts = (got[2][0][0][:, ::2, ::2] * 300.0).flatten()[None]
                assert torch.allclose(inputs["timestep"], ts) and keep.flatten().tolist() == [0, 1, 1]
            else:
                _, _, f, h, w = cond_latent.shape
                mask = wan_task.i2v_mask(1, f, h, w, dtype=torch.float32, device=torch.device("cpu"))
                assert torch.allclose(got[1], torch.cat([mask, cond_latent], dim=1), atol=1e-6)


def test_ti2v_loss_leaves_the_first_frame_out():
    """flow_loss with --task ti2v: the prediction's first frame does not reach the loss; the rest does."""
    from training.wan_diffusers.flow import flow_loss

    class Echo(torch.nn.Module):
        config = type("C", (), {"patch_size": (1, 2, 2)})()

        def __init__(self, bump_frame: int):
            super().__init__()
            self.bump = bump_frame

        def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
            out = hidden_states.clone()
            out[:, :, self.bump] += 5.0
            return (out,)
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(1, 4, 3, 4, 4, generator=g), "target": torch.randn(1, 4, 3, 4, 4, generator=g),
             "t": torch.tensor([0.4]), "text": torch.zeros(1, 2, 8), "cond": torch.randn(1, 4, 3, 4, 4, generator=g)}
    task = wan_task.WanTask("ti2v")
    plain = Echo(0)
    base = flow_loss(plain, batch, None, task)
    want = (batch["x"][:, :, 1:] - batch["target"][:, :, 1:]).pow(2).mean()
    assert torch.allclose(base, want)
    assert not torch.allclose(flow_loss(Echo(1), batch, None, task), base)


def test_expert_timestep_ranges():
    from training.video_dit.data import SyntheticVideoLatents
    from training.wan_diffusers.flow import WanStepBatches
    data = SyntheticVideoLatents(4, [2], 4, 4, 2, 8, seed=0)
    for expert, ok in (("high", lambda t: t >= 0.875), ("low", lambda t: t < 0.875)):
        task = wan_task.WanTask("t2v", expert, 0.875)
        b = WanStepBatches(data, start=0, stop=40, seed=1, dp_rank=0, dp_world=1, micro_batch=1, shift=5.0,
                           task=task)
        ts = [float(b[i]["t"]) for i in range(40)]
        assert all(ok(t) and 0 <= t <= 1 for t in ts), (expert, ts)


# ----------------------------------------------------------------------------- TI2V and an A14B expert

def _a14b_pipeline(path) -> dict:
    """A tiny Wan 2.2 A14B-shaped pipeline directory: model_index.json (boundary_ratio 0.875), transformer/ (high)
    and transformer_2/ (low) of different seeds. Returns {sub: state dict}."""
    os.makedirs(path)
    out = {}
    for sub, seed in (("transformer", 11), ("transformer_2", 12)):
        torch.manual_seed(seed)
        m = WanTransformer3DModel(**wan.preset_kwargs("tiny-a14b"))
        m.save_pretrained(os.path.join(path, sub), safe_serialization=True)
        out[sub] = {k: v.clone() for k, v in m.state_dict().items()}
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump({"_class_name": "WanPipeline", "boundary_ratio": 0.875, "expand_timesteps": False,
                   "transformer": ["diffusers", "WanTransformer3DModel"],
                   "transformer_2": ["diffusers", "WanTransformer3DModel"]}, f)
    return out


def test_ti2v_and_a14b_expert(tmp_path, capfd):
    ti2v_data, t2v_data, pipe = str(tmp_path / "ti2v"), str(tmp_path / "t2v"), str(tmp_path / "pipe")
    write_prepared(ti2v_data, "tiny-ti2v")
    write_prepared(t2v_data, "tiny")
    ti2v = run_ranks(_run, 2, [*BASE, "--model", "tiny-ti2v", "--data-path", ti2v_data, "--lora-rank", "2",
                               "--context-parallel-size", "2", "--train-iters", "2"], timeout=150)[0]
    assert len(ti2v[0]) == 2 and all(v == v for v in ti2v[0])
    weights = _a14b_pipeline(pipe)
    argv = [*BASE, "--init", pipe, "--text-len", "8", "--data-path", t2v_data]
    code = run_ranks(_user_error, 1, [*argv, "--train-iters", "1"], timeout=90)[0]
    err = capfd.readouterr().err
    assert code == 1 and "--expert high" in err and "Traceback" not in err, err
    for expert, sub in (("high", "transformer"), ("low", "transformer_2")):
        start = run_ranks(_run, 1, [*argv, "--expert", expert, "--train-iters", "0"], timeout=90)[0]
        assert all((start[1][n] == weights[sub][n].numpy()).all() for n in weights[sub]), expert
    low = run_ranks(_run, 2, [*argv, "--expert", "low", "--lora-rank", "2", "--context-parallel-size", "2",
                              "--train-iters", "2"], timeout=150)[0]
    assert len(low[0]) == 2


# ----------------------------------------------------------------------------- SP gradients, float64

def _grads64(rank, world, runs):
    keep_float64()
    out = []
    for argv in runs:
        res = entry.main(list(argv), grads_at=1, dtype=torch.float64)
        out.append({n: g.numpy() for n, g in res["grads"].items()})
    return out


def _sp_runs(sp: int) -> list:
    common = [*BASE, "--train-iters", "2", "--context-parallel-size", str(sp)]
    return [[*common, "--model", "tiny"],
            [*common, "--model", "tiny", "--lora-rank", "3", "--lora-alpha", "6"],
            [*common, "--model", "tiny", *SPARSE, "--sparse-window", "1,1,1"],
            [*common, "--model", "tiny", "--lora-rank", "3", *SPARSE, "--sparse-topk", "4"],
            [*common, "--model", "tiny-i2v", "--lora-rank", "2"],
            [*common, "--model", "tiny-ti2v"]]


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_gradients_equal_sp1_float64(sp):
    """Step 1's reduced gradients (after one update: LoRA's B is no longer zero) at SP=sp equal SP=1's within 1e-10
    (float64 model and batches, diffusers' .float() kept float64): full and LoRA, dense, window and top-k tiles,
    I2V LoRA and TI2V."""
    ref = run_ranks(_grads64, 1, _sp_runs(1), timeout=240)[0]
    got = run_ranks(_grads64, sp, _sp_runs(sp), timeout=400)
    for r in range(sp):
        for case, (a, b) in enumerate(zip(got[r], ref)):
            assert a.keys() == b.keys() and a, (case, sorted(set(a) ^ set(b))[:4])
            if case in (1, 3, 4):
                assert all("lora_" in n or "sparse_gate" in n for n in a), case
            for n in b:
                err = float(abs(a[n] - b[n]).max()) / max(1.0, float(abs(b[n]).max()))
                assert err <= TOL64, (sp, r, case, n, err)


# ----------------------------------------------------------------------------- recompute, FSDP2

def test_selective_recompute_equals_full_and_none():
    argv = [*BASE, "--model", "tiny", "--context-parallel-size", "2", "--train-iters", "2"]
    runs = {rc: run_ranks(_run, 2, argv + (["--recompute-granularity", rc] if rc else []), timeout=150)[0]
            for rc in (None, "full", "selective")}
    _equal(runs["selective"], runs[None], "selective vs none")
    _equal(runs["selective"], runs["full"], "selective vs full")


def _fused_run(rank, world, argv):
    """The trainer's run with --fused-elementwise on, its backend "aot_eager" with counted graph calls (the wiring;
    the compiled blocks' numbers: tests/test_diffusers_fused.py); (run, calls)."""
    from tests.test_diffusers_fused import Counting  # noqa: PLC0415
    counting = Counting()
    entry.resolve_fused = lambda choice, device: counting if choice == "on" else None   # this forked rank only
    return _run(rank, world, argv), counting.calls


def test_fused_elementwise_equals_eager():
    """SP=2, LoRA, window tiles, the attention kept: --fused-elementwise on (compiled blocks, counted) gives the
    losses and adapters of off (float32, to 1e-6)."""
    argv = [*BASE, "--model", "tiny", "--context-parallel-size", "2", "--train-iters", "2", "--lora-rank", "2",
            "--recompute-granularity", "selective", *SPARSE, "--sparse-window", "1,1,1"]
    for r, ((on, calls), (off, _)) in enumerate(zip(run_ranks(_fused_run, 2, [*argv, "--fused-elementwise", "on"]),
                                                    run_ranks(_fused_run, 2, [*argv, "--fused-elementwise", "off"]))):
        (l1, p1, _), (l0, p0, _) = on, off
        assert calls > 0 and p0.keys() == p1.keys(), (r, calls)
        assert max(abs(a - b) for a, b in zip(l1, l0)) <= 1e-6 * max(1.0, abs(l0[0])), (l1, l0)
        for n in p0:
            assert float(abs(p1[n] - p0[n]).max()) <= 1e-6 * max(1.0, float(abs(p0[n]).max())), n


def test_lora_fsdp2_selective_equals_dp(tmp_path):
    """4 ranks, SP=2 x DP=2 under FSDP2 (frozen base sharded) with the attention kept, vs DP=2 without: the same
    losses and adapters (fp32, 1e-5); the saved adapters gathered from the shards."""
    out = str(tmp_path / "lora")
    argv = [*BASE, "--model", "tiny", "--lora-rank", "2", "--train-iters", "2"]
    ref = run_ranks(_run, 2, argv, timeout=150)
    got = run_ranks(_run, 4, [*argv, "--context-parallel-size", "2", "--use-torch-fsdp2", "--recompute-granularity",
                              "selective", "--save-lora", out], timeout=240)
    for r in range(4):
        (l1, p1, _), (l0, p0, _) = got[r], ref[r // 2]
        assert max(abs(a - b) for a, b in zip(l1, l0)) <= 1e-5 * max(1.0, abs(l0[0])), (l1, l0)
        for n in p0:
            assert float(abs(p1[n] - p0[n]).max()) <= 1e-5 * max(1.0, float(abs(p0[n]).max())), n
    from safetensors.torch import load_file
    saved = load_file(os.path.join(out, "pytorch_lora_weights.safetensors"))
    for k, v in saved.items():
        name = k[len("transformer."):].replace(".weight", ".default.weight")
        assert torch.equal(v, torch.from_numpy(got[0][1][name])), k


# ----------------------------------------------------------------------------- flags

@pytest.mark.parametrize("argv, names", [
    (["--save-lora", "x"], ["--save-lora", "--lora-rank"]),
    (["--lora-alpha", "4"], ["--lora-alpha", "--lora-rank"]),
    (["--lora-rank", "-1"], ["--lora-rank"]),
    (["--lora-rank", "4", "--save-pretrained", "x"], ["--save-pretrained", "--save-lora"]),
    (["--lora-rank", "4", "--lora-target-modules", ","], ["--lora-target-modules"]),
    (["--model", "bogus"], ["--model"]),
    (["--task", "x2v"], ["--task"]),
    (["--fused-elementwise", "on", "--use-torch-fsdp2"], ["--fused-elementwise on", "--use-torch-fsdp2"]),
])
def test_bad_flags_refused_by_name(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        entry.parse([*BASE, *argv])
    assert e.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in names), err


@pytest.mark.parametrize("argv, words", [
    (["--model", "tiny", "--lora-rank", "2", "--lora-target-modules", "to_q,nope"], ["--lora-target-modules", "nope"]),
    (["--model", "tiny", "--task", "i2v"], ["--task i2v", "12"]),
    (["--model", "tiny-i2v", "--task", "t2v"], ["--task t2v"]),
    (["--model", "tiny", "--expert", "high"], ["--expert high", "--boundary-ratio"]),
    (["--model", "tiny-a14b", "--expert", "low", "--boundary-ratio", "1.5"], ["--boundary-ratio"]),
    (["--model", "tiny-ti2v", "--frames", "1"], ["--frames 1", "ti2v"]),
])
def test_bad_settings_are_one_message(argv, words, capfd):
    code = run_ranks(_user_error, 1, [*BASE, *argv, "--train-iters", "1"], timeout=60)[0]
    err = capfd.readouterr().err
    assert code == 1 and all(w in err for w in words) and "Traceback" not in err, err


# ----------------------------------------------------------------------------- LoRA and parallelize, either order

def _lora_orders(rank, world):
    """LoRA added before and after parallelize (SP=world, Ulysses, float64, .float() kept float64): the output and
    the adapters' gradients (summed over the SP group) against stock diffusers + the same LoRA at one rank."""
    import copy
    import torch.distributed as dist
    from megatron_sp_ext.diffusers import parallelize
    from tests.wan_sp import forward_backward, tiny_wan, wan_inputs
    keep_float64()
    lora = wan_lora.LoraSettings(3, 6.0)
    stock, inputs = tiny_wan(), wan_inputs()
    wan_lora.add_lora(stock, lora, 5)
    stock = stock.double()
    with torch.no_grad():   # B away from zero, so every adapter gradient counts
        for n, p in stock.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    ref_out, ref_grads = forward_backward(stock, inputs, None)
    errs = {}
    for order in ("lora first", "parallelize first"):
        model = copy.deepcopy(stock)
        if order == "parallelize first":   # the same adapters, added to a parallelized model
            base = tiny_wan()
            parallelize(base, dist.group.WORLD, mode="ulysses")
            wan_lora.add_lora(base, lora, 5)
            base.load_state_dict(stock.state_dict())
            model = base.double()
        else:
            parallelize(model, dist.group.WORLD, mode="ulysses")
        out, grads = forward_backward(model, inputs, dist.group.WORLD)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert names and all("lora_" in n for n in names), names[:3]
        errs[order] = max([float((out - ref_out).abs().max())] +
                          [float((grads[n] - ref_grads[n]).abs().max()) for n in names])
    return errs


def test_lora_composes_with_parallelize_in_either_order():
    for errs in run_ranks(_lora_orders, 2, timeout=150):
        assert set(errs) == {"lora first", "parallelize first"} and max(errs.values()) <= TOL64, errs


def test_a_failed_rank0_write_is_one_named_error():
    """save_pretrained / save_lora share ``written_on_rank0``: rank 0's failure becomes one SPConfigError naming the
    flag and path; an SPConfigError passes as it is; other ranks write nothing."""
    import pytest as _pytest

    from megatron_sp_ext.errors import SPConfigError
    from training.wan_diffusers.model import written_on_rank0

    def broken():
        raise OSError("disk full")
    with _pytest.raises(SPConfigError, match=r"--save-lora /x: could not write the adapters \(OSError: disk full\)"):
        written_on_rank0(0, broken, "--save-lora /x: could not write the adapters")

    def refused():
        raise SPConfigError("named already")
    with _pytest.raises(SPConfigError, match="^named already$"):
        written_on_rank0(0, refused, "unused")
    assert written_on_rank0(0, lambda: 7, "unused") == 7
    assert written_on_rank0(1, broken, "unused") is None
