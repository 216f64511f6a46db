"""One attention factory (megatron_sp_ext.sp.factory): every mode through each entry point (Megatron's
SPDotProductAttention, DeepSpeed's SPDistributedAttention, the DiT's make_core) equals the functional API,
and no other module of the package maps a mode name to an algorithm."""
import ast
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("megatron.core")
pytest.importorskip("deepspeed")

import megatron_sp_ext as spx  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.reference import rel_err  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("ulysses", "hcms", "ring", "tasp", "usp", "tas", "torus", "auto")
H, D, NODES = 8, 8, 2


def _functional(mode, q, k, v, group, *, layout, placement, causal):
    """What ``mode`` computes, written with the public functional API."""
    kw = dict(causal=causal, layout=layout, placement=placement)
    if mode in ("ulysses", "hcms", "auto"):  # auto on CPU: Ulysses/HCMS (no timing without CUDA)
        return spx.ulysses_attention(q, k, v, group, head_chunks=1 if mode == "ulysses" else 2, **kw)
    if mode in ("ring", "tasp"):
        return spx.ring_attention(q, k, v, group, variant=mode, **kw)
    mesh = spx.build_sp_mesh(group, num_heads=H, placement=mode if mode != "torus" else "auto", nodes=NODES)
    if mode == "torus":
        return spx.torus_attention(q, k, v, mesh, **kw)
    return spx.hybrid_attention(q, k, v, mesh, head_chunks=2, **kw)


def _run(fn, q, k, v, do):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def _same(tag, got, want):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, f"{tag} {name} shape {a.shape} vs {b.shape}"
        assert rel_err(a, b) < 1e-6, f"{tag} {name}: {rel_err(a, b)}"


def _entries(rank, world):
    import importlib

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_sp_ext.megatron import SPTransformerConfig
    from megatron_sp_ext.megatron.core_attention import SPDotProductAttention
    from training.video_dit.engine import make_core
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    from megatron_sp_ext.deepspeed import SPDistributedAttention
    ps.initialize_model_parallel(context_parallel_size=world)
    group = ps.get_context_parallel_group()
    try:
        s, b = 4 * world, 2
        g = torch.Generator().manual_seed(11 + world)
        # this rank's shards (the content does not matter: every path sees the same tensors)
        q, k, v, do = (torch.randn(s // world, b, H, D, generator=g) for _ in range(4))
        for mode in MODES:
            # Megatron: [s, b, h, d] in zigzag placement, causal
            cfg = SPTransformerConfig(num_layers=1, hidden_size=H * D, num_attention_heads=H, context_parallel_size=world,
                                      cp_comm_type=mode, hcms_head_chunks=2, sp_nodes=NODES, attention_dropout=0.0,
                                      hidden_dropout=0.0)
            core = SPDotProductAttention(cfg, 1, AttnMaskType.causal, "self", cp_comm_type=mode)
            got = _run(lambda a, c, e: core(a, c, e, None).view(a.shape), q, k, v, do)
            want = _run(lambda a, c, e: _functional(mode, a, c, e, group, layout="sbhd", placement="zigzag",
                                                    causal=True), q, k, v, do)
            _same(f"megatron P={world} {mode}", got, want)
            # DeepSpeed: [b, s, h, d] (batch_dim_idx 0), contiguous, non-causal; the user's local attention
            qb, kb, vb, dob = (t.transpose(0, 1).contiguous() for t in (q, k, v, do))

            def local(a, c, e, *args, **kwargs):
                return F.scaled_dot_product_attention(a.transpose(1, 2), c.transpose(1, 2),
                                                      e.transpose(1, 2)).transpose(1, 2)
            ds = SPDistributedAttention(local, group, 2, 1, mode=mode, head_chunks=2, nodes=NODES)
            got = _run(lambda a, c, e: ds(a, c, e, 0), qb, kb, vb, dob)
            want = _run(lambda a, c, e: _functional(mode, a, c, e, group, layout="bshd", placement="contiguous",
                                                    causal=False), qb, kb, vb, dob)
            _same(f"deepspeed P={world} {mode}", got, want)
            # the DiT: [B, S_loc, H, D], contiguous, non-causal, kv_valid_len
            dit = make_core(mode, group, num_heads=H, head_chunks=2, nodes=NODES, backend="sdpa")
            got = _run(lambda a, c, e: dit(a, c, e, None), qb, kb, vb, dob)
            _same(f"dit P={world} {mode}", got, want)
            assert (getattr(dit, "packed", None) is not None) == (mode in ("ulysses", "hcms")), mode
            n = s - 3  # key padding through the factory as well
            got = _run(lambda a, c, e: dit(a, c, e, n), qb, kb, vb, dob)
            want = _run(lambda a, c, e: _functional_padded(mode, a, c, e, group, n), qb, kb, vb, dob)
            _same(f"dit P={world} {mode} kv_valid_len", got, want)
    finally:
        ps.destroy_model_parallel()
    return True


def _functional_padded(mode, q, k, v, group, n):
    kw = dict(causal=False, layout="bshd", placement="contiguous", kv_valid_len=n)
    if mode in ("ulysses", "hcms", "auto"):
        return spx.ulysses_attention(q, k, v, group, head_chunks=1 if mode == "ulysses" else 2, **kw)
    if mode in ("ring", "tasp"):
        return spx.ring_attention(q, k, v, group, variant=mode, **kw)
    mesh = spx.build_sp_mesh(group, num_heads=H, placement=mode if mode != "torus" else "auto", nodes=NODES)
    if mode == "torus":
        return spx.torus_attention(q, k, v, mesh, **kw)
    return spx.hybrid_attention(q, k, v, mesh, head_chunks=2, **kw)


@pytest.mark.parametrize("world", [2, 4])
def test_every_mode_through_every_entry_equals_functional_api(world):
    run_ranks(_entries, world, timeout=500)


def _deepspeed_auto_per_shape(rank, world):
    """DeepSpeed's JSON mode 'auto' is no longer resolved statically: the attention asks its ModePolicy per
    shape (forced to the ring here through the factory's chooser), like the Megatron and DiT entries."""
    from megatron_sp_ext.deepspeed import SPDistributedAttention
    from megatron_sp_ext.deepspeed.initialize import sp_config_from_deepspeed
    cfg, _ = sp_config_from_deepspeed({"sequence_parallel_ext": {"mode": "auto"}})
    group = dist.group.WORLD
    ds = SPDistributedAttention(None, group, 2, 1, sp_config=cfg, causal=False)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, H, D, generator=g) for _ in range(3))
    ds(q, k, v, 0, kv_valid_len=4 * world - 1)  # our kernels (padding): auto may pick the ring
    attn = ds.attention_for(H, H, "bshd")
    assert attn.auto and attn.mode == "hcms"
    seen = []
    attn.chooser = lambda *a: seen.append(a) or "ring"
    got = ds(q, k, v, 0, kv_valid_len=4 * world - 1)
    want = spx.ring_attention(q, k, v, group, variant="ring", placement="contiguous", kv_valid_len=4 * world - 1)
    assert seen and rel_err(got, want) < 1e-6
    return True


def test_deepspeed_auto_is_calibrated_per_shape():
    run_ranks(_deepspeed_auto_per_shape, 2)


ALGORITHMS = {"ulysses_attention", "ring_attention", "hybrid_attention", "torus_attention",
              "packed_ulysses_attention", "PackedUlysses"}


def _mode_dispatch(source: str) -> list:
    """Functions (with their nested closures) that call a sequence-parallel algorithm AND compare a value
    with a mode name (``mode == "ring"``, ``x in ("ulysses", "hcms")``, ``{"hcms": ...}``): mode-name-to-algorithm
    dispatch. Returns their names."""
    tree = ast.parse(source)
    found = []

    def is_mode(node):
        if isinstance(node, ast.Constant):
            return node.value in MODES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_mode(e) for e in node.elts)
        return False

    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = compares = False
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                calls = calls or name in ALGORITHMS
            elif isinstance(node, ast.Compare):
                compares = compares or any(is_mode(c) for c in [node.left, *node.comparators])
            elif isinstance(node, ast.Dict):
                compares = compares or any(k is not None and is_mode(k) for k in node.keys)
        if calls and compares:
            found.append(fn.name)
    return found


def _package_files():
    for top in ("megatron_sp_ext", "training"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(dirpath, f)


def test_mode_dispatch_only_in_factory():
    factory = os.path.join(ROOT, "megatron_sp_ext", "sp", "factory.py")
    with open(factory) as f:
        assert _mode_dispatch(f.read()), "the check must see the factory's own dispatch"
    # what the three entry points looked like before the factory (git e99e58e) is caught
    old = ('def attend(self, q, k, v, causal):\n    if self.mode in ("ring", "tasp"):\n'
           '        return ring_attention(q, k, v, self.cp_group, variant=self.mode)\n'
           '    return ulysses_attention(q, k, v, self.cp_group)\n')
    assert _mode_dispatch(old) == ["attend"]
    offenders = []
    for path in _package_files():
        if path == factory:
            continue
        with open(path) as f:
            names = _mode_dispatch(f.read())
        offenders += [f"{os.path.relpath(path, ROOT)}:{n}" for n in names]
    assert not offenders, f"mode-name-to-algorithm dispatch outside sp/factory.py: {offenders}"


def _one_rank_under_emulation(rank, world):
    """A one-rank attention (group None: Megatron's CP=1 path, the DiT's SP=1 reference) inside a job whose links are
    emulated (SPX_EMULATED_MACHINE_SIZE, the emulated-cluster runs): the one-rank path takes no transport (it
    built the emulated two-level transport over group None and crashed: found by the CUDA suite's Megatron family)."""
    import os

    from megatron_sp_ext.topology.emulate import MACHINE_SIZE_ENV
    os.environ[MACHINE_SIZE_ENV] = "1"
    try:
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, 16, H, D, generator=g, dtype=torch.float64) for _ in range(3))
        for mode in ("hcms", "ring", "torus", "auto"):
            attn = spx.make_attention(spx.SPConfig(mode=mode), None, num_heads=H)
            out = attn(q, k, v, causal=True)
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
            assert rel_err(out, ref) < 1e-12, mode
    finally:
        del os.environ[MACHINE_SIZE_ENV]
    return True


def test_one_rank_attention_under_emulated_links():
    run_ranks(_one_rank_under_emulation, 2)
