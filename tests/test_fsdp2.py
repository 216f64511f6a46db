"""--use-torch-fsdp2 in the megatron-core entry (CPU, gloo, fp32): FSDP2 over data x context ranks equals the
unsharded run (losses and every parameter after 3 steps), and its DCP checkpoint resumes at another SP size."""
import pytest

pytest.importorskip("megatron.core")

from tests.harness import run_ranks  # noqa: E402
from tests.gpu.suite_judge import verdict  # noqa: E402

BASE = ["--model", "tiny", "--cp-comm-type", "ulysses", "--frames", "4", "--latent-size", "6x10", "--quiet"]


def _run(rank, world, cp, steps, extra=()):
    from training import pretrain_video_dit
    res = pretrain_video_dit.main([*BASE, "--context-parallel-size", str(cp), "--train-iters", str(steps), *extra],
                                  return_params=True)
    # numpy, not tensors: a tensor put on the harness's queue travels as a shared-memory handle that the parent
    # can only open while this rank is alive, and a rank that exits first loses its result
    return res["losses"], {n: p.numpy() for n, p in res["params"].items()}


def _close(got, ref, what, tol=1e-6, param_tol=None):
    (l1, p1), (l0, p0) = got, ref
    assert len(l1) == len(l0) and all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(l1, l0)), \
        f"{what}: losses {l1} vs {l0}"
    assert p1.keys() == p0.keys()
    param_tol = tol if param_tol is None else param_tol
    for n in p0:
        err = float(abs(p1[n] - p0[n]).max())
        assert err <= param_tol, f"{what}: parameter {n} differs by {err}"


LR = 2e-3   # the entry's default --lr
# Parameters after Adam steps: FSDP2 reduce-scatters the gradients where the unsharded run all-reduces them (another
# summation order), and Adam's m / sqrt(v) turns a rounding-level difference on a gradient near its eps into a
# visible part of a step of up to LR (1.5e-6 on one element after 3 steps on one CPU, 2026-11-28; under 1e-6 on
# another). A sharding or reduction bug moves parameters by the order of a whole step: 1e-3 of LR per step stays
# far below that.
ADAM_TOL = 1e-3 * LR


@pytest.mark.parametrize("cp", [2, 4])  # SP=2 x DP=2 and SP=4, 4 ranks
def test_fsdp2_equals_unsharded(cp):
    steps = 3
    ref = run_ranks(_run, 4, cp, steps)
    got = run_ranks(_run, 4, cp, steps, ("--use-torch-fsdp2",))
    for r in range(4):   # losses to 1e-6 (relative); parameters within ADAM_TOL per step
        _close(got[r], ref[r], f"SP={cp} rank {r}", tol=1e-6, param_tol=ADAM_TOL * steps)


def test_fsdp2_recompute_full_equals_unsharded():
    ref = run_ranks(_run, 2, 2, 2)
    got = run_ranks(_run, 2, 2, 2, ("--use-torch-fsdp2", "--recompute-granularity", "full"))
    _close(got[0], ref[0], "recompute full")


def test_fsdp2_save_sp4_resume_sp2(tmp_path):
    ck = str(tmp_path / "ck")
    straight = run_ranks(_run, 4, 4, 5, ("--use-torch-fsdp2",))[0]
    first = run_ranks(_run, 4, 4, 3, ("--use-torch-fsdp2", "--save", ck))[0]
    loaded = run_ranks(_run, 2, 2, 3, ("--use-torch-fsdp2", "--load", ck))[0]  # load only (0 steps left)
    assert loaded[0] == [] and loaded[1].keys() == first[1].keys()
    for n in first[1]:  # the checkpoint itself reshards FSDP4 x SP4 -> FSDP2 x SP2 exactly
        assert (loaded[1][n] == first[1][n]).all(), f"parameter {n} changed through save SP=4 / load SP=2"
    rest = run_ranks(_run, 2, 2, 5, ("--use-torch-fsdp2", "--load", ck))[0]  # SP=2, FSDP over 2 ranks
    assert len(first[0]) == 3 and len(rest[0]) == 2
    assert first[0] == straight[0][:3]
    # another SP size sums attention in another order: equal to float rounding, not bit-exact
    _close((first[0] + rest[0], rest[1]), straight, "save SP=4 FSDP4, resume SP=2 FSDP2", tol=1e-5)


def test_fsdp2_refuses_distributed_optimizer(capsys):
    from training import pretrain_video_dit
    with pytest.raises(SystemExit):
        pretrain_video_dit.parse([*BASE, "--use-torch-fsdp2", "--use-distributed-optimizer"])
    err = capsys.readouterr().err
    assert "--use-torch-fsdp2" in err and "--use-distributed-optimizer" in err, err


# --- #52: what the model makes on the fly follows its inputs' device (FSDP2's root moves token ids to the GPU) ---

def test_rope_follows_token_ids_device():
    """rope_angles and RopeCache build on token_ids' device (meta here: no host tensor may enter); host ids keep
    the cache (one table per shape), device ids are computed where they are."""
    import torch

    from training.video_dit.rope import RopeCache, rope_angles
    grid, hd = (3, 4, 5), 24
    ids = torch.arange(60)
    host = rope_angles(ids, grid, hd)
    assert rope_angles(ids.to("meta"), grid, hd).device.type == "meta"
    cache = RopeCache()
    assert cache.get(ids.to("meta"), grid, hd, "meta").device.type == "meta"
    a = cache.get(ids, grid, hd, "cpu")
    assert torch.equal(a, host) and cache.get(ids.clone(), grid, hd, "cpu") is a  # cached for host ids
    assert cache.get_packed(ids.to("meta"), (20, 40), ((1, 4, 5), (2, 4, 5)), hd, "meta").device.type == "meta"


@pytest.mark.parametrize("path", ["plain", "padded", "packed", "recompute"])
def test_model_forward_on_inputs_device(path):
    """The whole DiT with every input (token ids included) on a device other than the host (meta), as FSDP2's
    root hands them over on CUDA: forward (and backward) build nothing on the host. The old RoPE mixed a host
    frequency table into the device ids (issue #52's 'cuda:0 and cpu')."""
    import torch

    from training.video_dit import VideoDiT, preset
    from training.video_dit.varlen import pack_info
    cfg = preset("tiny")
    with torch.device("meta"):
        model = VideoDiT(cfg)
    grid, s = (2, 3, 5), 30
    x = torch.empty(1, s, cfg.patch_volume, device="meta", requires_grad=True)
    t, text = torch.empty(1, device="meta"), torch.empty(1, cfg.text_len, cfg.text_dim, device="meta")
    ids = torch.arange(s, device="meta")
    if path == "packed":
        pk = pack_info((0, 12, 30), ((1, 3, 4), (2, 3, 3)), (0, 4, 8), 1, device="meta")
        out = model(x, torch.empty(2, device="meta"), text, torch.cat([torch.arange(12), torch.arange(18)]).to("meta"),
                    None, pack=pk)
    else:
        model.set_recompute("full" if path == "recompute" else None)
        out = model(x, t, text, ids, grid, kv_valid_len=28 if path == "padded" else None)
    assert out.device.type == "meta" and out.shape == (1, s, cfg.patch_volume)
    out.sum().backward()
    assert x.grad is not None and x.grad.device.type == "meta"


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_bf16_equals_unsharded_autocast(monkeypatch, world):
    """shard_model with bf16 compute weights (what --bf16 runs on CUDA) against the unsharded model under the same
    bf16 autocast (CPU autocast here; tests/gpu/cuda_fsdp2.py on the GPU): loss and every gradient within bf16
    tolerance. FSDP2's default cast_forward_inputs rounded the blocks' float64 RoPE angles and the timesteps to
    bf16 (gradients off by up to 52%)."""
    from tests.gpu import cuda_fsdp2
    monkeypatch.setattr(cuda_fsdp2, "DEV", "cpu")
    for rank_records in run_ranks(cuda_fsdp2.fsdp2_model_family, world, timeout=600):
        assert len(rank_records) == 4
        for r in rank_records:
            assert not verdict(r), (r["case"], verdict(r))


def test_fsdp2_selective_keep_core_equals_unsharded():
    """#67: FSDP2 with the two checkpoint regions around the attention core (--recompute-modules
    outside_core_attn; FSDP2's pre-backward all-gather serves both recomputed regions) equals the unsharded run
    without recompute."""
    ref = run_ranks(_run, 2, 2, 2)
    got = run_ranks(_run, 2, 2, 2, ("--use-torch-fsdp2", "--recompute-granularity", "selective",
                                    "--recompute-modules", "outside_core_attn"))
    _close(got[0], ref[0], "recompute selective outside_core_attn")


def _view_warnings(rank, world, entry_name, argv):
    import importlib
    import warnings
    entry = importlib.import_module(f"training.{entry_name}")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        entry.main(list(argv))
    return [str(w.message) for w in seen if "view tensor" in str(w.message)]


@pytest.mark.parametrize("entry_name,argv", [
    ("pretrain_video_dit", [*BASE, "--context-parallel-size", "2", "--train-iters", "1", "--use-torch-fsdp2"]),
    ("train_wan_diffusers", ["--model", "tiny", "--frames", "4", "--latent-size", "8x8", "--quiet",
                             "--context-parallel-size", "2", "--train-iters", "1", "--use-torch-fsdp2"]),
])
def test_fsdp2_outputs_are_not_views(entry_name, argv):
    """#83 item 7: FSDP2 warned "returned a view tensor" on both entries (the DiT's head Linear and diffusers'
    unpatchify return views; an in-place op on one would drop FSDP2's pre-backward hook): shard_model gives every
    sharded module's view outputs a tensor of their own, so the warning (and the risk) is gone."""
    if entry_name == "train_wan_diffusers":
        pytest.importorskip("diffusers")
    assert run_ranks(_view_warnings, 2, entry_name, argv) == [[], []]
