"""Stock DeepSpeed scripts (training/ds_examples) switch to our attention by the JSON block alone.

Each script runs a few fp32 steps on 2 gloo ranks (SP=2) with DeepSpeed's own Ulysses and with
``"sequence_parallel_ext": {"mode": ...}`` in the same JSON; the losses and grad norms must agree
within 1e-5 relative, our attention must be the one installed and must have run, and DeepSpeed's
must be untouched when the block is absent. The switch (``hook.activate``) is what the installed
``.pth`` runs when deepspeed is imported; a last test runs that ``.pth`` in a fresh interpreter.
"""
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")

import torch._dynamo  # noqa: E402,F401 - torch's optimizers import it on first use: ~13 s per forked rank otherwise

from megatron_sp_ext.errors import SPConfigError  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

# import once in the parent so that forked ranks start warm
importlib.import_module("training.ds_examples.train_ulysses")
if importlib.util.find_spec("transformers") is not None:
    importlib.import_module("training.ds_examples.train_alst_llama")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "sequence_parallel_size": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.003, "torch_adam": True}},
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "steps_per_print": 1000}


def _write(tmp_path, block):
    cfg = dict(BASE, **({"sequence_parallel_ext": block} if block is not None else {}))
    path = tmp_path / f"ds_{abs(hash(json.dumps(block, sort_keys=True)))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _installed_ulysses(engine):
    from deepspeed.sequence.layer import DistributedAttention

    from megatron_sp_ext.deepspeed import SPDistributedAttention
    mods = [m for m in engine.module.modules() if isinstance(m, DistributedAttention)]
    ours = [m for m in mods if isinstance(m, SPDistributedAttention)]
    return {"n": len(mods), "ours": len(ours), "calls": sum(m.calls for m in ours),
            "modes": sorted({m.cfg.mode for m in ours})}


def _installed_hf(engine):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from megatron_sp_ext.deepspeed.hf import SPUlyssesAttentionHF
    fn = ALL_ATTENTION_FUNCTIONS[engine.module.config._attn_implementation]
    mods = [c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, UlyssesSPAttentionHF)]
    ours = [m for m in mods if isinstance(m, SPUlyssesAttentionHF)]
    return {"n": len(mods), "ours": len(ours), "calls": sum(m.calls for m in ours),
            "modes": sorted({m.cfg.mode for m in ours})}


def _train(rank, world, script, config_path, installed, extra=()):
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # skip the ~25 s CPU op build
    from megatron_sp_ext.deepspeed.hook import activate
    activate()  # what the installed .pth does when deepspeed is imported
    mod = importlib.import_module(f"training.ds_examples.{script}")
    res = mod.main(["--deepspeed_config", config_path, "--steps", str(STEPS), *extra])
    return res["loss"], res["grad_norm"], globals()[installed](res["engine"])


def _rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


CASES = {  # id: (script, script args, what to inspect, blocks)
    "gpt_distributed_attention": ("train_ulysses", [], "_installed_ulysses",
                                  [{"mode": "ulysses"}, {"mode": "hcms", "head_chunks": 2},
                                   {"mode": "ring", "causal": True}]),
    "alst_llama_gqa": ("train_alst_llama", [], "_installed_hf",
                       [{"mode": "ulysses"}, {"mode": "hcms", "head_chunks": 2}]),
    # one kv head for 2 ranks: DeepSpeed replicates kv heads (kv_replication_factor 2)
    "alst_llama_mqa": ("train_alst_llama", ["--kv-heads", "1"], "_installed_hf", [{"mode": "hcms", "head_chunks": 2}]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_json_block_switches_attention_same_loss(case, tmp_path):
    script, extra, installed, blocks = CASES[case]
    if script == "train_alst_llama":
        pytest.importorskip("transformers")
    ref_loss, ref_gn, ref_inst = run_ranks(_train, 2, script, _write(tmp_path, None), installed, extra)[0]
    assert ref_inst["n"] >= 1 and ref_inst["ours"] == 0, f"without the block DeepSpeed's attention stays: {ref_inst}"
    assert ref_loss[-1] < ref_loss[0], f"the script must learn: {ref_loss}"
    for block in blocks:
        loss, gn, inst = run_ranks(_train, 2, script, _write(tmp_path, block), installed, extra)[0]
        assert inst["ours"] == inst["n"] >= 1 and inst["modes"] == [block["mode"]], f"{block}: {inst}"
        assert inst["calls"] >= STEPS * inst["n"], f"{block}: our attention ran {inst['calls']} times"
        assert _rel(loss, ref_loss) < 1e-5, f"{case} {block}: loss {loss} vs DeepSpeed {ref_loss}"
        assert _rel(gn, ref_gn) < 1e-5, f"{case} {block}: grad norm {gn} vs DeepSpeed {ref_gn}"


def test_stock_script_at_sp1_equals_the_block_at_sp2(tmp_path):
    """#70 item 1's reference (tests/gpu/check_deepspeed_sp1.py): the stock GPT script at SP=1 on one rank (DeepSpeed's
    SP state refuses a size of 1: the script then gives each rank a group of its own and no mpu) against the block
    at SP=2, fp32, no clip: losses within 1e-5; DeepSpeed's SP=2 gradient norm is 2 x SP=1's (the engine does not
    divide by the SP size; Adam is invariant to it), with DeepSpeed's attention and ours alike."""
    def cfg(sp, block):
        path = tmp_path / f"sp{sp}_{bool(block)}.json"
        path.write_text(json.dumps(dict(BASE, sequence_parallel_size=sp, gradient_clipping=0.0,
                                        **({"sequence_parallel_ext": block} if block else {}))))
        return str(path)
    ref_loss, ref_gn, ref_inst = run_ranks(_train, 1, "train_ulysses", cfg(1, None), "_installed_ulysses")[0]
    assert ref_inst["ours"] == 0 and ref_inst["n"] >= 1
    for block in (None, {"mode": "ulysses", "dropout_p": 0.0}):
        loss, gn, inst = run_ranks(_train, 2, "train_ulysses", cfg(2, block), "_installed_ulysses")[0]
        assert inst["ours"] == (inst["n"] if block else 0), (block, inst)
        assert _rel(loss, ref_loss) < 1e-5, f"{block}: SP=2 loss {loss} vs SP=1 {ref_loss}"
        assert _rel([g / 2 for g in gn], ref_gn) < 1e-5, f"{block}: SP=2 grad norm {gn} vs SP=1 {ref_gn}"


def _bad_block(rank, world, script, config_path):
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    from megatron_sp_ext.deepspeed.hook import activate
    activate()
    mod = importlib.import_module(f"training.ds_examples.{script}")
    try:
        mod.main(["--deepspeed_config", config_path, "--steps", "1"])
    except SPConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("script,block,key", [
    ("train_ulysses", {"mode": "hcmz"}, "sequence_parallel_ext.mode"),
    ("train_ulysses", {"mode": "hcms", "head_chunks": 0}, "sequence_parallel_ext.head_chunks"),
    ("train_ulysses", {"mode": "hcms", "chunks": 2}, "sequence_parallel_ext.chunks"),
    # the causal GPT's DistributedAttention: the ring runs our kernels, DeepSpeed does not say "causal"
    ("train_ulysses", {"mode": "ring"}, "sequence_parallel_ext.causal"),
    ("train_alst_llama", {"mode": "ring"}, "sequence_parallel_ext.mode"),
])
def test_bad_block_names_the_key(script, block, key, tmp_path):
    if script == "train_alst_llama":
        pytest.importorskip("transformers")
    errors = run_ranks(_bad_block, 2, script, _write(tmp_path, block))
    for err in errors:
        assert err is not None and key in err, f"{block}: {err!r} does not name {key}"


def test_block_without_sp_attention_is_an_error():
    import deepspeed

    from megatron_sp_ext.deepspeed.hook import activate, deactivate
    activate()
    try:
        with pytest.raises(SPConfigError, match="sequence_parallel_ext is set but the model has no DeepSpeed"):
            deepspeed.initialize(model=torch.nn.Linear(2, 2), config=dict(BASE, sequence_parallel_ext={"mode": "hcms"}))
        from megatron_sp_ext.deepspeed.hook import install
        assert install(torch.nn.Linear(2, 2), dict(BASE, sequence_parallel_size=1, sequence_parallel_ext={})) == 0
        with pytest.raises(SPConfigError, match="sequence_parallel_ext must be a JSON object"):
            deepspeed.initialize(model=torch.nn.Linear(2, 2), config=dict(BASE, sequence_parallel_ext="hcms"))
    finally:
        deactivate()


def test_unknown_key_lists_every_valid_key():
    from megatron_sp_ext.deepspeed.initialize import sp_config_from_deepspeed
    with pytest.raises(SPConfigError, match=r"sequence_parallel_ext.chunks is not a known setting: valid keys are "
                                            r"(\w+, )*causal, (\w+, )*mode, "):
        sp_config_from_deepspeed({"sequence_parallel_ext": {"chunks": 2}})


def _causal_per_call(rank, world):
    """Our kernels (ring) run with sequence_parallel_ext.causal; a causal= / is_causal= the caller passes for its
    local attention must agree (DeepSpeed forwards them to it), else an error naming both."""
    from megatron_sp_ext.deepspeed import SPDistributedAttention
    from megatron_sp_ext.deepspeed.initialize import sp_config_from_deepspeed
    from tests.reference import rel_err
    import megatron_sp_ext as spx
    g = torch.distributed.group.WORLD
    q, k, v = (torch.randn(1, 4, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    cfg, extras = sp_config_from_deepspeed({"sequence_parallel_ext": {"mode": "ring", "causal": True}})
    attn = SPDistributedAttention(None, g, 2, 1, sp_config=cfg, causal=extras["causal"])
    want = spx.ring_attention(q, k, v, g, causal=True, placement="contiguous")
    assert rel_err(attn(q, k, v, 0, is_causal=True), want) < 1e-6
    with pytest.raises(SPConfigError, match=r"this call passes is_causal=False for the local attention, but "
                                            r"sequence_parallel_ext.mode='ring' runs megatron_sp_ext's kernels with "
                                            r"sequence_parallel_ext.causal True"):
        attn(q, k, v, 0, is_causal=False)
    return True


def test_call_causal_must_agree_with_the_block():
    assert all(run_ranks(_causal_per_call, 2))


def test_config_is_found_where_deepspeed_looks(tmp_path):
    """config=, config_params=, args.deepspeed_config; dict or JSON path; unreadable -> left to DeepSpeed."""
    import argparse

    from megatron_sp_ext.deepspeed.hook import config_of
    path = _write(tmp_path, {"mode": "hcms"})
    want = json.loads(open(path).read())
    assert config_of(None, {"config": path}) == want
    assert config_of(None, {"config_params": want}) == want
    assert config_of(argparse.Namespace(deepspeed_config=path), {}) == want
    assert config_of(argparse.Namespace(deepspeed_config=None), {}) is None
    assert config_of(None, {"config": str(tmp_path / "missing.json")}) is None


def test_pth_autoload_activates_on_deepspeed_import(tmp_path):
    """The .pth shipped with the package: cheap at start-up, wraps deepspeed.initialize once imported. Where the
    switch is off (MEGATRON_SP_EXT_DEEPSPEED_HOOK=0) or its import fails, deepspeed.initialize is only guarded: a
    config holding the block is refused by name (it would be ignored), one without it goes to DeepSpeed."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    with open(os.path.join(ROOT, "megatron_sp_ext_autoload.pth")) as f:
        (site_dir / "megatron_sp_ext_autoload.pth").write_text(f.read())
    broken = tmp_path / "broken"  # a package whose import fails, before the real one on the path
    (broken / "megatron_sp_ext").mkdir(parents=True)
    (broken / "megatron_sp_ext" / "__init__.py").write_text("raise ImportError('simulated breakage')\n")
    (broken / "megatron_sp_ext_autoload.py").write_text(open(os.path.join(ROOT, "megatron_sp_ext_autoload.py")).read())
    code = ("import site, sys; site.addsitedir(sys.argv[1]); "
            "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'the .pth must stay cheap'; "
            "hooked = any(type(f).__name__ == '_Finder' for f in sys.meta_path); "
            "deepspeed = __import__('deepspeed') if hooked else None; "
            "marker = getattr(deepspeed.initialize, '_megatron_sp_ext', False) if hooked else False; "
            "print(hooked, marker)\n"
            "if marker == 'guard':\n"
            "    try: deepspeed.initialize(model=None, config={'sequence_parallel_ext': {'mode': 'hcms'}})\n"
            "    except ValueError as e: print(type(e).__name__, e)\n"
            "    try: deepspeed.initialize(model=None, config={})\n"
            "    except ValueError as e: print('no block refused', e)\n"
            "    except Exception as e: print('to DeepSpeed', type(e).__name__)\n")
    guarded = "sequence_parallel_ext is in the DeepSpeed config but megatron_sp_ext's JSON switch is not active ("
    # ("1", ROOT): "True True", the switch itself, is test_stock_script_in_an_editable_install's first check
    for flag, path, want in (("0", ROOT, ["True guard", f"SPConfigError {guarded}MEGATRON_SP_EXT_DEEPSPEED_HOOK=0 "
                                                        "turns it off)", "to DeepSpeed"]),
                             ("1", f"{broken}{os.pathsep}{ROOT}",
                              ["True guard", f"ValueError {guarded}its import failed: ImportError: simulated breakage)",
                               "to DeepSpeed"])):
        env = dict(os.environ, PYTHONPATH=path, DS_ACCELERATOR="cpu", MEGATRON_SP_EXT_DEEPSPEED_HOOK=flag)
        out = subprocess.run([sys.executable, "-c", code, str(site_dir)], env=env, capture_output=True, text=True,
                             cwd=tmp_path,  # not ROOT: "-c" puts the working directory first on sys.path
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        lines = out.stdout.strip().splitlines()[-len(want):]
        assert [line[:len(w)] for line, w in zip(lines, want)] == want, (flag, out.stdout, out.stderr[-2000:])


def test_guard_reads_the_config_as_the_hook_does(tmp_path):
    """The start-up guard's stdlib reader (megatron_sp_ext_autoload.has_section) and the hook's agree."""
    import argparse

    import megatron_sp_ext_autoload as autoload
    from megatron_sp_ext.deepspeed.hook import SECTION_KEY, config_of
    with_block, without = _write(tmp_path, {"mode": "hcms"}), _write(tmp_path, None)
    cases = [((), {"config": with_block}), ((), {"config": without}), ((), {"config_params": {SECTION_KEY: {}}}),
             ((argparse.Namespace(deepspeed_config=with_block),), {}), ((), {"args": argparse.Namespace(
                 deepspeed_config=with_block)}), ((argparse.Namespace(deepspeed_config=None),), {}),
             ((), {"config": str(tmp_path / "missing.json")}), ((), {})]
    for args, kwargs in cases:
        config = config_of(args[0] if args else kwargs.get("args"), kwargs)
        assert autoload.has_section(args, kwargs) == (config is not None and SECTION_KEY in config), (args, kwargs)
    assert autoload.SECTION_KEY == SECTION_KEY


# ---- installed as `make` installs it (pip install -e .): the start-up hook is in place, the block never ignored ----

PACKAGE_FILES = ("setup.py", "pyproject.toml", "README.md", "megatron_sp_ext_autoload.py", "megatron_sp_ext_autoload.pth")


def _build(tmp_path, hook: str) -> str:
    """Build the package's ``hook`` ("build_editable": pip install -e; "build_wheel") from a copy of its sources."""
    import shutil
    src, out = tmp_path / "src", tmp_path / "out"
    if not src.exists():
        src.mkdir()
        for name in PACKAGE_FILES:
            shutil.copy(os.path.join(ROOT, name), src / name)
        shutil.copytree(os.path.join(ROOT, "megatron_sp_ext"), src / "megatron_sp_ext",
                        ignore=shutil.ignore_patterns("__pycache__"))
    code = f"import sys; from setuptools import build_meta; print(build_meta.{hook}(sys.argv[1]))"
    res = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return str(out / res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def editable_site(tmp_path_factory):
    """What ``pip install -e .`` puts in site-packages: the editable wheel's files, unpacked."""
    import zipfile
    tmp = tmp_path_factory.mktemp("editable")
    site_dir = tmp / "site"
    zipfile.ZipFile(_build(tmp, "build_editable")).extractall(site_dir)
    return str(site_dir)


def test_wheel_and_editable_install_carry_the_pth(tmp_path, editable_site):
    """Both a wheel and an editable install put megatron_sp_ext_autoload.pth at the top of site-packages (setuptools'
    editable wheels once carried no .pth: the hook was off in `make`'s .venv and the block silently ignored)."""
    import zipfile
    with open(os.path.join(ROOT, "megatron_sp_ext_autoload.pth")) as f:
        want = f.read()
    with open(os.path.join(editable_site, "megatron_sp_ext_autoload.pth")) as f:
        assert f.read() == want
    with zipfile.ZipFile(_build(tmp_path, "build_wheel")) as whl:
        assert whl.read("megatron_sp_ext_autoload.pth").decode() == want
        assert "megatron_sp_ext_autoload.py" in whl.namelist()


def _stock(site_dir, *config_paths, **env):
    env = dict(os.environ, PYTHONPATH=ROOT, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **env)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "stock_deepspeed.py"), site_dir, *config_paths],
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_stock_script_in_an_editable_install(tmp_path, editable_site):
    """train_ulysses.py, unchanged, in a fresh interpreter whose site-packages is the editable install's: the
    JSON block alone switches the attention (ours runs), and a bad block fails naming its key."""
    got = _stock(editable_site, _write(tmp_path, {"mode": "bogus"}), _write(tmp_path, {"mode": "hcms", "head_chunks": 2}))
    assert got["hooked"] is True, got
    bogus, hcms = got["runs"]
    want = "SPConfigError: sequence_parallel_ext.mode='bogus' is invalid: choose one of ulysses, hcms"
    assert all(r.get("error", "").startswith(want) for r in bogus), bogus
    assert all(r.get("attention") == ["SPDistributedAttention"] for r in hcms), hcms
