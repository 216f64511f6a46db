"""The kernel registry (megatron_sp_ext/attention/kernels/): every list of kernel names derives from it, every kernel
declares what it can do and says why it cannot run a call, and no kernel name is compared anywhere outside it."""
import ast
import pathlib
import re

import torch

from megatron_sp_ext import modes
from megatron_sp_ext.attention import backends, block_sparse, kernels, lse_kernels, varlen
from megatron_sp_ext.attention.kernels import KernelCall
from megatron_sp_ext.config import BACKENDS

from tests.source_scan import ROOT, offenders

SCANNED = ("megatron_sp_ext", "training", "tools", "tests/gpu")
NAMES = set(kernels.ORDER) | set(kernels.settings()) | set(kernels.varlen_methods())


def _compared_names(path: pathlib.Path) -> list:
    """(line, name) of every comparison (==, !=, in, not in) of a kernel name literal in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare) or not any(
                isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            continue
        sides = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, sides, sides[1:]):
            if isinstance(op, (ast.Eq, ast.NotEq)):       # x == "fa4", "fa4" != x
                consts = [left, right]
            elif isinstance(op, (ast.In, ast.NotIn)):     # x in ("fa4", ...): a container of names on the right
                consts = right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else []
            else:
                continue
            found += [(node.lineno, c.value) for c in consts if isinstance(c, ast.Constant) and c.value in NAMES]
    return found


def test_no_kernel_name_is_compared_outside_the_registry():
    found = offenders(SCANNED, _compared_names, skip=lambda p: "attention/kernels" in p.as_posix())
    assert not found, f"kernel names compared outside attention/kernels/: {found}"


def test_the_scan_finds_a_comparison(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(k):\n    return k == 'fa4' or k in ('cudnn', 'x') or 'flash' in k\n\nfor n in ('fa4',):\n"
                   "    pass\n")
    assert _compared_names(bad) == [(2, "fa4"), (2, "cudnn")]


def test_every_list_of_names_derives_from_the_registry():
    assert set(BACKENDS) == {"auto", "sdpa"} | {kernels.get(n).setting for n in kernels.ORDER
                                                if kernels.get(n).offered and (
                                                    kernels.get(n).caps.lse and kernels.get(n).caps.dense
                                                    or kernels.get(n).caps.tiles == "none")}
    assert lse_kernels.KERNELS == kernels.names("lse", auto_only=True)
    assert set(varlen.KERNEL_METHODS) == {kernels.get(n).caps.varlen for n in kernels.names("varlen")}
    assert block_sparse.KERNELS == ("auto",) + tuple(kernels.get(n).setting for n in kernels.names("tiles",
                                                                                                     auto_only=True))
    assert backends.backend_names() == BACKENDS


def _caps_fields_read(paths) -> set:
    """Names ``f`` read as ``caps.f`` or ``<x>.caps.f`` anywhere in ``paths`` (a declaration or a keyword argument
    ``Capabilities(f=...)`` is not a read)."""
    read = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and (
                    isinstance(node.value, ast.Name) and node.value.id == "caps"
                    or isinstance(node.value, ast.Attribute) and node.value.attr == "caps"):
                read.add(node.attr)
    return read


def test_every_capability_field_is_read_by_the_library():
    """A field of Capabilities that no code of the library reads is a declaration nothing decides on (issue 66:
    ``gqa`` and ``partial_tiles`` were): read it where the choice is made, or remove it."""
    import dataclasses  # noqa: PLC0415
    fields = {f.name for f in dataclasses.fields(kernels.Capabilities)}
    unread = fields - _caps_fields_read((ROOT / "megatron_sp_ext").rglob("*.py"))
    assert not unread, f"Capabilities fields declared and never read: {sorted(unread)}"


def test_the_capability_scan_sees_reads_only(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("caps = Capabilities(gqa=True)\ndef f(k, caps):\n    return k.caps.lse or caps.tiles\n")
    assert _caps_fields_read([src]) == {"lse", "tiles"}


def test_every_kernel_declares_and_explains():
    cpu = torch.device("cpu")
    for n in kernels.ORDER:
        k = kernels.get(n)
        assert k.name == n and k.label and k.setting
        for needs in (("plain",), ("lse",), ("varlen",), ("tiles",), ("dropout",)):
            reason = k.why_not(KernelCall(cpu, torch.bfloat16, 64, frozenset(needs)))
            assert reason is None or isinstance(reason, str) and len(reason) > 10, (n, needs, reason)
    assert kernels.get("math").why_not(KernelCall(cpu, torch.float64, 64, frozenset({"lse", "tiles"}))) is None
    assert "block sparsity" in kernels.get("cudnn").why_not(KernelCall(cpu, torch.bfloat16, 64, frozenset({"tiles"})))


def test_auto_picks_the_first_kernel_that_runs_the_call():
    cpu = torch.device("cpu")
    assert kernels.pick(KernelCall(cpu, torch.float32, 64, frozenset({"lse"}))).name == kernels.names("lse")[2]
    assert kernels.pick(KernelCall(cpu, torch.float64, 64, frozenset({"lse"}))).name == kernels.FALLBACK
    assert kernels.pick(KernelCall(cpu, torch.bfloat16, 64, frozenset({"tiles", "lse"}))).name == kernels.FALLBACK


# ---- the one kernel choice (megatron_sp_ext/attention/kernels/choose.py) ----
CHOOSER = "megatron_sp_ext/attention/kernels/choose.py"
CHOICE_CALLS = {("kernels", "pick"), ("kernels", "require"), ("kernels", "auto_order"), ("lse_kernels", "best")}
ORDER_READS = {("kernels", "AUTO"), ("kernels", "TILE_ORDER")}   # the orders "auto" tries: the chooser's to read
AUTO_WORD = "sdpa"   # the backend setting's older word for "auto": what it means is decided by kernels.is_auto only


def _choices_made(path: pathlib.Path) -> list:
    """(line, what) of every kernel choice made outside the chooser in ``path``: a call of the choice's parts
    (``kernels.pick/require/auto_order``, ``lse_kernels.best``), a read of the orders "auto" tries (``kernels.AUTO``,
    ``kernels.TILE_ORDER``), a read of a kernel's ``in_torch_sdpa``, and a comparison with "sdpa" or a literal tuple
    holding "auto" and "sdpa" (what "sdpa" means)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", None)
            if node.attr == "in_torch_sdpa" or (owner, node.attr) in ORDER_READS:
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            owner = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if (owner, node.func.attr) in CHOICE_CALLS:
                found.append((node.lineno, f"{owner}.{node.func.attr}("))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            words = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if {"auto", AUTO_WORD} <= words:
                found.append((node.lineno, "('auto', 'sdpa')"))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(c, ast.Constant) and c.value == AUTO_WORD for c in sides):
                found.append((node.lineno, "== 'sdpa'"))
    return sorted(set(found))


def test_no_kernel_choice_is_made_outside_the_chooser():
    found = offenders(SCANNED, _choices_made, skip=lambda p: p.relative_to(ROOT).as_posix() == CHOOSER)
    assert not found, f"kernel choices made outside {CHOOSER} (call kernels.choose / candidates): {found}"


# the library's calls of torch's SDPA: only the registry's kernels make them (kernels/sdpa.py: torch's dispatch), so
# the chooser sees every decision. Not scanned: tools/ and tests/gpu (they time torch's own SDPA as the floor a kernel
# is measured against) and training/ds_examples (a DeepSpeed user's script that does not know megatron_sp_ext).
SDPA_SCANNED = ("megatron_sp_ext", "training")
SDPA_EXEMPT = ("megatron_sp_ext/attention/kernels/", "training/ds_examples/")


def _sdpa_calls(path: pathlib.Path) -> list:
    """(line, name) of every use of torch's SDPA in ``path``: ``scaled_dot_product_attention`` (called or passed on),
    its backend switch ``sdpa_kernel``, and the aten ops behind it (``_scaled_dot_product_*``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else \
            getattr(node, "name", None) if isinstance(node, ast.alias) else None
        if name in ("scaled_dot_product_attention", "sdpa_kernel") or (name or "").startswith("_scaled_dot_product"):
            found.append((getattr(node, "lineno", 0), name))
    return sorted(set(found))


def test_no_sdpa_call_outside_the_registry():
    found = offenders(SDPA_SCANNED, _sdpa_calls,
                      skip=lambda p: p.relative_to(ROOT).as_posix().startswith(SDPA_EXEMPT))
    assert not found, f"torch SDPA called outside attention/kernels/ (use kernels.plain_kernel / dropout_kernel / " \
                      f"torch_sdpa: the registry's SDPA kernel): {found}"


def test_the_sdpa_scan_finds_calls(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.nn.functional as F\nfrom torch.nn.attention import sdpa_kernel\n"
                   "def f(q):\n    return F.scaled_dot_product_attention(q, q, q)\n"
                   "g = torch.ops.aten._scaled_dot_product_flash_attention\n")
    assert [line for line, _ in _sdpa_calls(bad)] == [2, 4, 5]
    assert _sdpa_calls(ROOT / "megatron_sp_ext/attention/kernels/sdpa.py"), "the SDPA kernel calls it: seen"


def test_the_sdpa_kernel_is_the_chooser_s_and_no_setting():
    """torch's SDPA dispatch is a registry kernel reached through the chooser only: "auto"'s plain calls where the lse
    kernel is one of torch's, dropout (refused by name for a kernel without), the models' explicit masks."""
    from megatron_sp_ext.errors import SPConfigError  # noqa: PLC0415
    sdpa = kernels.get(kernels.SDPA)
    assert kernels.SDPA in kernels.ORDER and not sdpa.offered and kernels.SDPA not in kernels.settings()
    assert kernels.by_setting(kernels.SDPA) is None and kernels.SDPA not in BACKENDS
    assert kernels.plain_kernel(kernels.get("math")) is sdpa and kernels.plain_kernel(kernels.get("flash")) is sdpa
    assert kernels.plain_kernel(kernels.get("fa4")) is kernels.get("fa4")
    assert kernels.dropout_kernel("auto", "backend", 0.1) is sdpa and kernels.torch_sdpa() is sdpa
    try:
        kernels.dropout_kernel("fa4", "--sp-attention-backend", 0.1)
    except SPConfigError as e:
        assert str(e).startswith("--sp-attention-backend='fa4' cannot apply attention dropout (dropout_p=0.1)"), e
    else:
        raise AssertionError("a kernel without dropout must be refused by name")
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(0)) < 0.6
    mask[:, 0] = True
    ref = torch.softmax((q @ q.transpose(-1, -2) * 8 ** -0.5).masked_fill(~mask, float("-inf")), -1) @ q
    torch.testing.assert_close(sdpa.call(q, q, q, mask=mask), ref)
    torch.testing.assert_close(backends.get_backend("auto")(q, q, q, causal=False, softmax_scale=None),
                               torch.softmax(q @ q.transpose(-1, -2) * 8 ** -0.5, -1) @ q)


def test_the_choice_scan_finds_choices(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(q, be, call, name):\n    k = kernels.pick(call)\n    k = kernels.require(k, call, 'x')\n"
                   "    k = lse_kernels.best(q.device, q.dtype)\n    r = kernels.AUTO.index('cudnn')\n"
                   "    t = kernels.get(k).in_torch_sdpa\n    a = name in ('auto', 'sdpa')\n"
                   "    b = name == 'sdpa'\n    return kernels.choose(call, name), kernels.candidates(call)\n")
    assert [line for line, _ in _choices_made(bad)] == [2, 3, 4, 5, 6, 7, 8]
    assert _choices_made(ROOT / CHOOSER), "the chooser itself makes the choice: the scan must see it there"


def test_the_chooser_decides_auto_and_named_settings():
    """One function for every call: "auto" and "sdpa" pick the first candidate that runs the call (math last), a
    kernel's setting runs that kernel or is refused naming the user's setting and the reason; the candidates are the
    lists the log-sum-exp blocks, the varlen methods and the block-sparse kernels use."""
    from megatron_sp_ext.errors import SPConfigError  # noqa: PLC0415
    cpu = torch.device("cpu")
    lse32 = KernelCall(cpu, torch.float32, 64, frozenset({"lse"}))
    assert kernels.candidates(lse32) == lse_kernels.KERNELS
    assert kernels.candidates(KernelCall(cpu, torch.float32, 64, frozenset({"varlen"})), "auto", after="flash") == \
        tuple(n for n in kernels.names("varlen", auto_only=True) if n in kernels.AUTO[kernels.AUTO.index("flash"):])
    assert kernels.candidates(lse32, "torch_flash") == ("flash",) and kernels.candidates(lse32, "te") == ()
    for setting in kernels.AUTO_SETTINGS:
        assert kernels.is_auto(setting) and kernels.choose(lse32, setting).name == "flash"
    assert not kernels.is_auto("math") and kernels.choose(lse32, "math").name == "math"
    assert kernels.choose(KernelCall(cpu, torch.float64, 64, frozenset({"lse"}))).name == kernels.FALLBACK
    try:
        kernels.choose(lse32, "cudnn", name="--sp-attention-backend")
    except SPConfigError as e:
        assert str(e).startswith("--sp-attention-backend='cudnn' cannot run here (cpu, torch.float32, head dim 64): "
                                 "it does not run on cpu; use 'auto' (kernels that run it here: flash, math)"), e
    else:
        raise AssertionError("cudnn on the CPU must be refused naming the setting")
    try:
        kernels.choose(lse32, "cudnnn", name="backend")
    except SPConfigError as e:
        assert "backend='cudnnn' is invalid" in str(e), e
    else:
        raise AssertionError("an unknown setting must be refused")
    # the probe a caller adds (lse_kernels.why_not_call) decides as the kernel's own conditions do
    assert kernels.choose(lse32, "auto", why_not=lambda k, c: None if k.name == "math" else "no").name == "math"


# ---- the mode registry (megatron_sp_ext/modes.py) ----
MODE_NAMES = set(modes.NAMES) - {"auto"}   # "auto" is also every policy setting's word: flagged only against a mode
MODE_WORDS = ("mode", "cp_comm_type")       # what a value called like this holds is a mode
# the files that may compare mode names: the registry, and the one factory that maps a mode's family to its algorithm
MODE_EXEMPT = ("megatron_sp_ext/modes.py", "megatron_sp_ext/sp/factory.py")


def _compared_modes(path: pathlib.Path) -> list:
    """(line, name) of every comparison (==, !=, in, not in) of a mode-name literal in ``path`` ("auto" only where
    the other side names a mode: ``cfg.mode == "auto"``), and of every literal tuple/list/set of two or more mode
    names (a list of modes)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in MODE_NAMES]
            if len(names) >= 2:
                found += [(node.lineno, n) for n in names]
            continue
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, sides, sides[1:]):
            if isinstance(op, (ast.Eq, ast.NotEq)):
                pairs = [(left, right), (right, left)]
            elif isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
                pairs = [(e, left) for e in right.elts]
            else:
                continue
            for const, other in pairs:
                if not isinstance(const, ast.Constant) or not isinstance(const.value, str):
                    continue
                about_mode = any(w in ast.unparse(other) for w in MODE_WORDS)
                if const.value in MODE_NAMES or (const.value == "auto" and about_mode):
                    found.append((node.lineno, const.value))
    return sorted(set(found))


def _error_lists(path: pathlib.Path) -> list:
    """(line, text) of every error message (the string parts of a ``raise``'s or ``p.error``'s arguments) that
    lists two or more mode names written out ("use ulysses or hcms"): such lists come from the registry."""
    pattern = re.compile(r"\b(%s)\b\s*(,|or|/|and)\s*'?\b(%s)\b" % ("|".join(MODE_NAMES), "|".join(MODE_NAMES)))
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        calls = []
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            calls = [node.exc]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "error":
            calls = [node]
        for call in calls:
            for arg in ast.walk(call):
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and pattern.search(arg.value):
                    found.append((arg.lineno, arg.value))
    return found


def _mode_files() -> list:
    return [p for d in ("megatron_sp_ext", "training") for p in (ROOT / d).rglob("*.py")
            if p.relative_to(ROOT).as_posix() not in MODE_EXEMPT]


def test_no_mode_name_is_compared_outside_the_registry():
    files = _mode_files()
    assert len(files) > 50
    offenders = {str(p.relative_to(ROOT)): hits for p in files if (hits := _compared_modes(p))}
    assert not offenders, f"mode names compared or listed outside modes.py / sp/factory.py: {offenders}"


def test_error_messages_list_modes_from_the_registry():
    offenders = {str(p.relative_to(ROOT)): hits for p in _mode_files() if (hits := _error_lists(p))}
    assert not offenders, f"error messages that write out a list of modes (use modes.names/listing): {offenders}"


def test_the_mode_scans_find_comparisons_and_lists(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(cfg, t, p):\n    a = cfg.mode == 'auto' or t in ('ulysses', 'x') or p.placement != 'tas'\n"
                   "    b = p.head_chunks == 'auto'\n    MODES = ('ring', 'tasp')\n"
                   "    raise ValueError(f'{t} needs a head per rank: use ring, tasp or usp')\n")
    assert _compared_modes(bad) == [(2, "auto"), (2, "tas"), (2, "ulysses"), (4, "ring"), (4, "tasp")]
    assert [line for line, _ in _error_lists(bad)] == [5]


def test_every_list_of_modes_derives_from_the_mode_registry():
    from megatron_sp_ext import config
    from megatron_sp_ext.comm import capability
    from megatron_sp_ext.sp import factory
    from megatron_sp_ext.sp.ring import VARIANTS

    assert config.MODES == modes.NAMES and len(set(modes.NAMES)) == len(modes.NAMES)
    assert config.MESH_MODES == tuple(m.name for m in modes.MODES if m.mesh)
    assert config.DROPOUT_MODES == tuple(m.name for m in modes.MODES if m.dropout and not m.auto)
    assert config.DYNAMIC_MODES == tuple(m.name for m in modes.MODES if m.dynamic)
    assert config.RING_VARIANTS == VARIANTS == factory.RING_MODES == tuple(m.name for m in modes.MODES
                                                                          if m.ring_variant)
    assert config.ARRANGEMENTS == ("auto",) + tuple(m.name for m in modes.MODES if m.arrangement)
    assert [m.name for m in modes.MODES if capability.needs_p2p(m.name, 4)] == [m.name for m in modes.MODES if m.p2p]
    assert not any(capability.needs_p2p(n, 1) for n in modes.NAMES)
    for name in modes.NAMES:
        m = modes.get(name)
        assert m.family in modes.FAMILIES and m.summary
        assert m.local_attention <= m.heads_per_rank, name   # a caller's attention runs on whole heads
        assert not (m.p2p and m.dropout), name                # log-sum-exp merged partials carry no dropout
        assert m.arrangement <= m.mesh and m.ulysses_across <= m.arrangement, name
        assert m.head_chunks is None or modes.get(m.with_chunks).head_chunks is None, name
    assert modes.get(modes.resolve_auto(8, 4)).family == "ulysses"
    assert modes.get(modes.resolve_auto(2, 4)).arrangement and modes.get(modes.resolve_auto(3, 4)).ring_variant
    try:
        modes.names(bogus=True)
    except TypeError as e:
        assert "bogus" in str(e)
    else:
        raise AssertionError("an unknown field must raise")


def _declared(rank, world):
    import dataclasses

    import torch.distributed as dist

    from megatron_sp_ext.config import SPConfig
    from megatron_sp_ext.errors import SPConfigError
    from megatron_sp_ext.sp.factory import make_attention

    q = torch.randn(1, 8, 2, 8)
    out = {}
    for flag, kw in (("packed", {"cu_seqlens": torch.tensor([0, 16])}),
                     ("block_mask", {"block_mask": torch.ones(1, 2, 2, dtype=torch.bool), "block_size": 8})):
        plain = make_attention(SPConfig(mode="ring"), dist.group.WORLD, num_heads=2)   # as declared: it runs
        ran = tuple(plain(q, q, q, causal=False, **kw).shape) == tuple(q.shape)
        attn = make_attention(SPConfig(mode="ring"), dist.group.WORLD, num_heads=2)
        attn.spec = dataclasses.replace(attn.spec, **{flag: False})
        try:
            attn(q, q, q, causal=False, **kw)
            out[flag] = (ran, "ran")
        except SPConfigError as e:
            out[flag] = (ran, str(e))
    return out


def test_the_factory_reads_what_a_mode_declares():
    """Packed samples and block masks run where the registry says: a mode declared without them is refused by name
    (every mode takes both today; the declaration is what the factory reads)."""
    from tests.harness import run_ranks
    for out in run_ranks(_declared, 2, timeout=60):
        for flag, arg in (("packed", "cu_seqlens"), ("block_mask", "block_mask")):
            ran, msg = out[flag]
            assert ran and msg.startswith(f"{arg} is not supported by mode='ring': use ulysses, hcms"), out
