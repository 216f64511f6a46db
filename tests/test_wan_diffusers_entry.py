"""training/train_wan_diffusers.py on CPU (gloo, fp32, the tiny Wan config): SP=2 equals SP=1 (losses, the first
step's reduced gradients, the parameters after the run), SP=2 x DP=2 under FSDP2 with gradient checkpointing equals
DP=2, top-k / window sparse SP=2 equals SP=1 (gates through --save-pretrained / --init), a local diffusers checkpoint
round trip (save_pretrained -> --init DIR -> save / resume bit-identical -> --save-pretrained reads back with the
same output), --data-path safetensors latents, and bad flags / another model's checkpoint refused by name."""
import json

import pytest

pytest.importorskip("diffusers", reason="needs diffusers (pip install 'megatron_sp_ext[diffusers]')")

import torch  # noqa: E402

import torch.distributed.checkpoint.state_dict  # noqa: E402,F401  (what the ranks import, imported once here before
import torch.distributed.fsdp  # noqa: E402,F401   the harness forks them: each rank then starts in well under a second)
from diffusers import WanTransformer3DModel  # noqa: E402,F401
import megatron_sp_ext.diffusers  # noqa: E402,F401
import megatron_sp_ext.diffusers.sparse  # noqa: E402,F401
from tests.harness import run_ranks  # noqa: E402
from training import train_wan_diffusers as entry  # noqa: E402
from training.wan_diffusers import model as wan  # noqa: E402

BASE = ["--model", "tiny", "--frames", "4", "--latent-size", "8x8", "--quiet", "--cp-comm-type", "ulysses"]
TOL = 1e-5
SPARSE = ["--sparse-attention", "tiles", "--sparse-tile", "1,2,2"]


def _run(rank, world, argv, grads_at=None):
    res = entry.main(list(argv), return_params=True, grads_at=grads_at)
    # numpy, not tensors: a tensor on the harness's queue is a shared-memory handle that dies with its rank
    return (res["losses"], {n: p.numpy() for n, p in res["params"].items()},
            {n: g.numpy() for n, g in res.get("grads", {}).items()})


def _close(got, ref, what, tol=TOL):
    (l1, p1, g1), (l0, p0, g0) = got, ref
    assert len(l1) == len(l0) and all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(l1, l0)), \
        f"{what}: losses {l1} vs {l0}"
    for name, a, b in (("gradient", g1, g0), ("parameter", p1, p0)):
        assert a.keys() == b.keys(), f"{what}: {name} names differ"
        for n in b:
            scale = max(1.0, float(abs(b[n]).max()))
            err = float(abs(a[n] - b[n]).max())
            assert err <= tol * scale, f"{what}: {name} {n} differs by {err}"


def test_presets_match_the_video_dit_and_diffusers_wan21():
    from training.video_dit.config import PRESETS
    for name in ("wan-1.3b", "wan-14b"):
        cfg, dit = wan.dit_config(wan.preset_kwargs(name), 512), PRESETS[name]
        assert (cfg.dim, cfg.heads, cfg.ffn, cfg.layers, cfg.in_channels, cfg.patch, cfg.text_dim, cfg.text_len) == \
            (dit.dim, dit.heads, dit.ffn, dit.layers, dit.in_channels, dit.patch, dit.text_dim, dit.text_len), name
    assert wan.preset_kwargs("wan-1.3b")["num_layers"] == 30
    assert wan.preset_kwargs("wan-14b")["num_attention_heads"] == 40
    assert wan.preset_kwargs("wan-14b", 4)["num_layers"] == 4


def test_sp2_equals_sp1():
    steps = ["--train-iters", "3"]
    ref = run_ranks(_run, 1, [*BASE, *steps], 0, timeout=120)[0]
    got = run_ranks(_run, 2, [*BASE, *steps, "--context-parallel-size", "2"], 0, timeout=120)
    for r in range(2):
        _close(got[r], ref, f"SP=2 rank {r}")


def test_sp2_x_dp2_fsdp2_recompute_equals_dp2(tmp_path):
    """4 ranks: FSDP2 averages over all of them; the backward's sp factor makes it the SUM over SP, mean over DP
    (training/wan_diffusers/loop.py); with diffusers' gradient checkpointing. --save-pretrained gathers the shards."""
    steps, out = ["--train-iters", "2"], str(tmp_path / "out")
    ref = run_ranks(_run, 2, [*BASE, *steps], 0, timeout=150)
    got = run_ranks(_run, 4, [*BASE, *steps, "--context-parallel-size", "2", "--use-torch-fsdp2",
                              "--recompute-granularity", "full", "--save-pretrained", out], 0, timeout=150)
    for r in range(4):
        _close(got[r], ref[r // 2], f"SP=2 x DP=2 FSDP2 rank {r}")
    saved = wan.load_model(out, torch.device("cpu")).state_dict()
    assert all(torch.equal(saved[n], torch.from_numpy(p)) for n, p in got[0][1].items())


def _tiny_pretrained(path):
    from diffusers import WanTransformer3DModel
    torch.manual_seed(7)
    WanTransformer3DModel(**wan.preset_kwargs("tiny")).save_pretrained(path, safe_serialization=True)


def test_init_from_dir_save_resume_save_pretrained(tmp_path):
    init, ck, out = str(tmp_path / "init"), str(tmp_path / "ck"), str(tmp_path / "out")
    _tiny_pretrained(init)
    argv = [*BASE, "--init", init, "--text-len", "8", "--context-parallel-size", "2"]
    straight = run_ranks(_run, 2, [*argv, "--train-iters", "5"], timeout=120)[0]
    first = run_ranks(_run, 2, [*argv, "--train-iters", "3", "--save", ck], timeout=120)[0]
    rest = run_ranks(_run, 2, [*argv, "--train-iters", "5", "--load", ck, "--save-pretrained", out],
                     timeout=120)[0]
    assert first[0] == straight[0][:3] and rest[0] == straight[0][3:], (first[0], rest[0], straight[0])
    for n in straight[1]:
        assert (rest[1][n] == straight[1][n]).all(), f"parameter {n}: resumed run differs from the straight one"
    from diffusers import WanTransformer3DModel
    trained = WanTransformer3DModel(**wan.preset_kwargs("tiny"))
    trained.load_state_dict({n: torch.from_numpy(p) for n, p in rest[1].items()})
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 4, 4, 8, 8, generator=g), torch.randn(1, 8, 32, generator=g)
    # diffusers 0.42 reads this model with from_pretrained only where accelerate is installed; the entry's reader
    # (model.load_model) reads the same files without it
    readers = {"entry": lambda d: wan.load_model(d, torch.device("cpu"))}
    if wan.has_accelerate():
        readers["from_pretrained"] = WanTransformer3DModel.from_pretrained
    for how, read in readers.items():
        back = read(out)
        with torch.no_grad():
            a = back(x, torch.tensor([300.0]), text, return_dict=False)[0]
            b = trained(x, torch.tensor([300.0]), text, return_dict=False)[0]
        assert torch.equal(a, b), how
        start = read(init)
        assert any(not torch.equal(p, back.state_dict()[n]) for n, p in start.state_dict().items()), how


def _user_error(rank, world, argv):
    from training.video_dit.faults import run_entry
    return run_entry(entry.main, entry.WHAT, list(argv))


@pytest.mark.parametrize("argv, names", [
    (["--cp-comm-type", "bogus"], ["--cp-comm-type"]),
    (["--context-parallel-size", "3"], ["--context-parallel-size"]),
    (["--init", "somewhere", "--num-layers", "4"], ["--num-layers", "--init"]),
    (["--pack-samples"], ["--pack-samples"]),
    (["--sparse-topk", "3"], ["--sparse-topk", "--sparse-attention"]),
    (["--timestep-shift", "0"], ["--timestep-shift"]),
    (["--modulation", "linear"], ["--modulation"]),
    ([*SPARSE, "--sparse-topk", "4", "--micro-batch-size", "2"], ["--sparse-topk", "--micro-batch-size"]),
])
def test_bad_flags_refused_by_name(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        entry.parse([*BASE, *argv])
    assert e.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in names), err


def test_bad_init_dir_is_one_message(tmp_path, capfd):
    (tmp_path / "notamodel").mkdir()
    for path, words in ((str(tmp_path / "missing"), "no such directory"), (str(tmp_path / "notamodel"),
                                                                          "no config.json")):
        code = run_ranks(_user_error, 1, [*BASE, "--init", path, "--train-iters", "1"], timeout=60)[0]
        err = capfd.readouterr().err.strip().splitlines()
        assert code == 1 and any("--init" in line and words in line for line in err), err
        assert not any("Traceback" in line for line in err), err


def _save_into(rank, world, out_dir):
    from megatron_sp_ext.errors import SPConfigError
    model = wan.random_model(wan.preset_kwargs("tiny"), 0, torch.device("cpu"))
    try:
        wan.save_pretrained(model, out_dir, rank)
    except SPConfigError as e:
        return str(e)
    return None


def test_save_pretrained_failure_on_rank0_raises_on_every_rank(tmp_path):
    """Rank 0 cannot write --save-pretrained (its directory lies under a file): every rank raises the same user
    error naming the directory, none waits in a collective until the timeout."""
    (tmp_path / "afile").write_text("")
    out = str(tmp_path / "afile" / "out")
    got = run_ranks(_save_into, 2, out, timeout=60)
    assert got[0] is not None and got[0] == got[1], got
    assert "--save-pretrained" in got[0] and out in got[0], got
    ok = str(tmp_path / "ok")
    assert run_ranks(_save_into, 2, ok, timeout=60) == [None, None]
    assert (tmp_path / "ok" / "config.json").is_file()


def test_sparse_sp2_equals_sp1_and_gates_round_trip(tmp_path):
    """Top-k (VSA, gated coarse branch) at SP=2 equals SP=1; --save-pretrained writes the gates beside the model's
    files and --init reads them back (the window plan is the same code path with a fixed mask)."""
    out = str(tmp_path / "out")
    argv = [*BASE, *SPARSE, "--sparse-topk", "4", "--train-iters", "2"]
    ref = run_ranks(_run, 1, argv, 0, timeout=120)[0]
    got = run_ranks(_run, 2, [*argv, "--context-parallel-size", "2", "--save-pretrained", out], 0, timeout=120)[0]
    _close(got, ref, "top-k SP=2")
    gates = {n for n in got[1] if ".sparse_gate." in n}
    assert gates and any(abs(got[1][n]).max() > 0 for n in gates), "the gates did not train"
    assert wan.gate_names(out) == gates
    back = run_ranks(_run, 1, [*BASE, *SPARSE, "--sparse-topk", "4", "--init", out, "--text-len", "8",
                               "--train-iters", "0"], timeout=120)[0]
    for n in got[1]:
        assert (back[1][n] == got[1][n]).all(), f"{n}: not read back from --init"
    win = [*BASE, *SPARSE, "--sparse-window", "1,1,1", "--train-iters", "2"]
    _close(run_ranks(_run, 2, [*win, "--context-parallel-size", "2"], 0, timeout=120)[0],
           run_ranks(_run, 1, win, 0, timeout=120)[0], "window SP=2")


def test_data_path_safetensors_equals_synthetic(tmp_path):
    """--data-path: latent + text files (safetensors) holding the synthetic samples train exactly as the synthetic
    source does (the noise and timestep of sample i come from --seed and i either way)."""
    from training.video_dit.data import SyntheticVideoLatents, write_sample
    cfg = wan.dit_config(wan.preset_kwargs("tiny"), 8)
    syn = SyntheticVideoLatents(cfg.in_channels, [4], 8, 8, cfg.text_len, cfg.text_dim, seed=1234)
    for i in range(3):
        s = syn[i]
        write_sample(str(tmp_path / f"s{i}.safetensors"), s["latent"], s["text"], fmt="safetensors")
    argv = [*BASE, "--train-iters", "3", "--seed", "1234"]
    logs = tmp_path / "logs"
    files = run_ranks(_run, 1, [*argv, "--data-path", str(tmp_path), "--log-dir", str(logs)], timeout=120)[0]
    synthetic = run_ranks(_run, 1, argv, timeout=120)[0]
    assert files[0] == synthetic[0], (files[0], synthetic[0])
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == files[0] and all(r["tokens"] == 64 for r in rows)
    assert (logs / "loss.png").is_file() and (logs / "step_time.png").is_file()


def test_data_path_tokens_not_dividing_by_sp_refused(tmp_path, capfd):
    """--data-path: a clip of 4x2x2 latents (4 tokens at the patch 1x2x2) divides by SP=2, one of 3x2x2 (3 tokens)
    does not: refused at start-up on every rank, naming --data-path, the file and the sizes."""
    from training.video_dit.data import write_sample
    cfg = wan.dit_config(wan.preset_kwargs("tiny"), 8)
    text = torch.zeros(8, cfg.text_dim)
    write_sample(str(tmp_path / "a.safetensors"), torch.zeros(cfg.in_channels, 4, 2, 2), text, fmt="safetensors")
    write_sample(str(tmp_path / "b.safetensors"), torch.zeros(cfg.in_channels, 3, 2, 2), text, fmt="safetensors")
    code = run_ranks(_user_error, 2, [*BASE, "--train-iters", "1", "--context-parallel-size", "2", "--data-path",
                                      str(tmp_path)], timeout=60)
    err = capfd.readouterr().err
    assert code == [1, 1], (code, err)
    line = [ln for ln in err.splitlines() if "--data-path" in ln]
    assert len(line) == 1 and "b.safetensors" in line[0] and "3x2x2" in line[0] and "3 tokens" in line[0] \
        and "--context-parallel-size=2" in line[0] and "Traceback" not in err, err


def test_bf16_on_cpu_is_refused_by_name(capfd):
    """--bf16 (bf16 autocast, CUDA) on the CPU: one message naming it, as the video DiT entry (it once ran fp32)."""
    code = run_ranks(_user_error, 1, [*BASE, "--bf16", "--train-iters", "1"], timeout=60)[0]
    err = capfd.readouterr().err
    assert code == 1 and "--bf16 (bf16 autocast) runs on CUDA devices" in err and "Traceback" not in err, err


def test_resume_hint_of_a_pretrained_start_names_init(tmp_path, capfd):
    """A checkpoint of an --init DIR run, resumed with another model: the hint names --init DIR (the run's own
    setting), not "--model pretrained" (no such preset); the reverse names --init random --model."""
    init, ck, ck2 = str(tmp_path / "init"), str(tmp_path / "ck"), str(tmp_path / "ck2")
    _tiny_pretrained(init)
    run_ranks(_run, 1, [*BASE, "--init", init, "--train-iters", "1", "--save", ck], timeout=60)
    run_ranks(_run, 1, [*BASE, "--train-iters", "1", "--save", ck2], timeout=60)
    capfd.readouterr()
    code = run_ranks(_user_error, 1, [*BASE, "--train-iters", "2", "--load", ck], timeout=60)[0]
    err = capfd.readouterr().err
    assert code == 1 and f"resume with --init {init}" in err and "--model pretrained" not in err, err
    code = run_ranks(_user_error, 1, [*BASE, "--init", init, "--train-iters", "2", "--load", ck2], timeout=60)[0]
    err = capfd.readouterr().err
    assert code == 1 and "(--init random --model tiny --num-layers" in err, err


def test_resume_of_another_model_is_refused(tmp_path, capfd):
    ck = str(tmp_path / "ck")
    run_ranks(_run, 1, [*BASE, "--train-iters", "1", "--save", ck], timeout=60)
    capfd.readouterr()
    code = run_ranks(_user_error, 1, [*BASE, "--train-iters", "2", "--load", ck, "--num-layers", "1"], timeout=60)[0]
    err = capfd.readouterr().err
    assert code == 1 and "another model" in err and "--num-layers" in err and "Traceback" not in err, err
    assert "--modulation" not in err, err   # diffusers' model has no such setting: the hint does not name it
