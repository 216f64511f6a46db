"""#66 item 1 / #85: the attention problem (megatron_sp_ext/sp/problem.py), built once and bound per call.

The one table of refusals (every refusal names its keyword and the function), the bound problem's fields for a few
inputs, the four public functions binding their problem (an AST scan, with a check that the scan can fail), and a
problem (with its block mask) agreed across ranks once over repeated calls of each public function (all_gathers
counted with a spy; outputs and gradients against the float64 masked reference). gloo, CPU, P=2."""
import ast
import inspect
import textwrap

import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext import modes
from megatron_sp_ext.attention.backends import wrap_callable
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp import problem as pb
from megatron_sp_ext.sp.placement import PackedSamples
from megatron_sp_ext.sp.ring import hybrid, ring, torus
from megatron_sp_ext.sp.ulysses import function
from tests.harness import run_ranks
from tests.test_block_sparse import check_case, random_mask

S, H, D, BS = 16, 4, 8, 4
T = S // BS


class GatherCount:
    """Counts the cross-rank agreements (``checks.agree_across_ranks`` as the problem calls it: one collective each)
    while active."""

    def __init__(self) -> None:
        self.calls, self._orig = 0, None

    def __enter__(self) -> "GatherCount":
        self._orig = pb.agree_across_ranks

        def counted(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)
        pb.agree_across_ranks = counted
        return self

    def __exit__(self, *exc) -> None:
        pb.agree_across_ranks = self._orig


def bind(q, g, what, mode, variant=None, varlen_kernel="per_sample", **settings):
    """The bound problem of ``settings`` (``block_size`` for ``tile``) for a call of ``what`` (mode ``mode``)."""
    if "block_size" in settings:
        settings["tile"] = settings.pop("block_size")
    return pb.AttentionProblem(**settings).bind(q, q, q, g, what=what, mode=mode, variant=variant,
                                                varlen_kernel=varlen_kernel)


# ------------------------------------------------------------------------------------------ the refusal table
def _refusals(rank, world):
    """Every row of the table, through ``describe`` and through the public function that takes the keyword: each
    message names the keyword(s) and the function."""
    g = dist.group.WORLD
    q = torch.randn(1, S // world, H, D, dtype=torch.float64)
    bm = torch.ones(1, T, T, dtype=torch.bool)
    cu = torch.tensor([0, S // 2, S])
    mesh = spx.build_sp_mesh(g, num_heads=H, placement="tas", ulysses_size=world, nodes=world)
    desc = lambda what="ulysses_attention", mode="ulysses", **kw: bind(q, g, what, mode, **kw)  # noqa: E731
    cases = [  # (pattern, call)
        (r"block_mask cannot be combined with cu_seqlens \(ulysses_attention\)",
         lambda: spx.ulysses_attention(q, q, q, g, block_mask=bm, block_size=BS, cu_seqlens=cu)),
        (r"block_mask cannot be combined with cu_seqlens \(ring_attention\)",
         lambda: spx.ring_attention(q, q, q, g, block_mask=bm, block_size=BS, cu_seqlens=cu)),
        (r"block_mask cannot be combined with cu_seqlens \(hybrid_attention\)",
         lambda: desc("hybrid_attention", "usp", block_mask=bm, block_size=BS, cu_seqlens=cu)),
        (r"block_mask cannot be combined with dropout_p \(ulysses_attention\): leave dropout_p at 0.0",
         lambda: spx.ulysses_attention(q, q, q, g, block_mask=bm, block_size=BS, dropout_p=0.1)),
        (r"block_mask cannot be combined with seq_order \(ulysses_attention\)",
         lambda: spx.ulysses_attention(q, q, q, g, block_mask=bm, block_size=BS, seq_order=object())),
        (r"kv_valid_len cannot be combined with cu_seqlens \(ulysses_attention\)",
         lambda: spx.ulysses_attention(q, q, q, g, kv_valid_len=5, cu_seqlens=cu)),
        (r"kv_valid_len cannot be combined with cu_seqlens \(ring_attention\)",
         lambda: spx.ring_attention(q, q, q, g, kv_valid_len=5, cu_seqlens=cu)),
        (r"seq_order cannot be combined with cu_seqlens \(ulysses_attention\)",
         lambda: spx.ulysses_attention(q, q, q, g, seq_order=object(), cu_seqlens=cu)),
        # capabilities come from the mode registry: a mode without the flag refuses the keyword
        (r"dropout_p is not supported by ring_attention \(mode 'ring'\): modes that take it: "
         + modes.listing(modes.names(dropout=True)),
         lambda: desc("ring_attention", "ring", dropout_p=0.1)),
        (r"dropout_p=1.5 is invalid", lambda: spx.ulysses_attention(q, q, q, g, dropout_p=1.5)),
        (r"varlen_kernel='bogus' is invalid", lambda: spx.ulysses_attention(q, q, q, g, varlen_kernel="bogus")),
        (r"variant='ring3' is invalid", lambda: spx.ring_attention(q, q, q, g, variant="ring3")),
        (r"ring_variant='ring3' is invalid",
         lambda: desc("hybrid_attention", "usp", variant=("ring_variant", "ring3"))),
        (r"ring_variant='ring3' is invalid", lambda: spx.torus_attention(q, q, q, mesh, ring_variant="ring3")),
        (r"kv_valid_len=0 leaves no key to attend", lambda: spx.ring_attention(q, q, q, g, kv_valid_len=0)),
        (r"kv_valid_len=-1 leaves no key to attend", lambda: spx.ulysses_attention(q, q, q, g, kv_valid_len=-1)),
        (r"block_mask must be a bool tensor", lambda: spx.ring_attention(q, q, q, g, block_mask=bm.long(),
                                                                         block_size=BS)),
        (r"tile=0 \(block_size=0\) is invalid", lambda: spx.ulysses_attention(q, q, q, g, block_mask=bm, block_size=0)),
        (r"block_mask runs megatron_sp_ext's block-sparse kernels .* not backend='user'",
         lambda: spx.ulysses_attention(q, q, q, g, block_mask=bm, block_size=BS,
                                       backend=wrap_callable(lambda *a, **kw: None, "user"))),
        (r"layout='bsdh' is invalid", lambda: spx.ring_attention(q, q, q, g, layout="bsdh")),
        (r"cu_seqlens needs batch size 1", lambda: spx.ring_attention(q.expand(2, -1, -1, -1),
                                                                      q.expand(2, -1, -1, -1),
                                                                      q.expand(2, -1, -1, -1), g, cu_seqlens=cu)),
    ]
    for pattern, call in cases:
        with pytest.raises(SPConfigError, match=pattern):
            call()
    return len(cases)


def test_every_refusal_names_its_keyword_and_function():
    assert run_ranks(_refusals, 2, timeout=60) == [21, 21]


def test_the_table_covers_every_refused_pair_and_every_capability_flag():
    """The combination rows name keywords of the builder, and each capability row names a registry flag."""
    keywords = set(pb.PROBLEM_KEYWORDS)
    for name, other, advice, _ in pb.COMBINATIONS:
        assert {name, other} <= keywords and advice, (name, other)
    flags = set(modes.FLAGS)
    for name, flag in pb.CAPABILITIES:
        assert name in keywords and flag in flags, (name, flag)
    # the registry decides: a mode refuses a keyword exactly where its flag is off
    for m in modes.MODES:
        for name, flag in pb.CAPABILITIES:
            given = {"block_mask": False, "cu_seqlens": False, "dropout_p": False, "seq_order": False,
                     "kv_valid_len": False, name: True}
            if getattr(m, flag):
                pb.refuse("f", given, False, m)
            else:
                with pytest.raises(SPConfigError, match=f"{name} is not supported by f \\(mode '{m.name}'\\)"):
                    pb.refuse("f", given, False, m)


# ------------------------------------------------------------------------------------------ the problem value
def _fields(rank, world):
    g = dist.group.WORLD
    q_sbhd = torch.randn(S // world, 1, H, D, dtype=torch.float64)
    pr = bind(q_sbhd, g, "ring_attention", "ring", causal=True, layout="sbhd", placement="zigzag", kv_valid_len=S)
    assert (pr.layout, pr.world, pr.rank, pr.batch, pr.s_loc, pr.seqlen) == ("sbhd", world, rank, 1, S // world, S)
    assert pr.causal and pr.scale == pytest.approx(D ** -0.5) and pr.kv_valid_len is None   # cuts nothing: None
    assert pr.packed is None and pr.segments is None and pr.block_mask is None and pr.dropout_p == 0.0
    assert pr.mode is modes.get("ring") and pr.backend.name and not pr.own_positions
    half = S // (2 * world)
    assert pr.runs(rank) == ((rank * half, half), (S - (rank + 1) * half, half))   # zigzag: [r, 2P-1-r]
    x = torch.arange(S // world * H * D, dtype=torch.float64).view(S // world, 1, H, D)
    (xb,) = pr.to_kernel(x)
    assert xb.shape == (1, H, S // world, D) and torch.equal(pr.from_kernel(xb), x)
    assert torch.equal(pb.to_bshd(pb.to_bshd(x, "sbhd"), "sbhd"), x) and pb.to_bshd(x, "bshd") is x

    q = torch.randn(1, S // world, H, D, dtype=torch.float64)
    cu = torch.tensor([0, 6, S])
    pr = bind(q, g, "ulysses_attention", "ulysses", softmax_scale=0.5, cu_seqlens=cu, dropout_p=0.25,
              varlen_kernel="grouped")
    assert isinstance(pr.packed, PackedSamples) and pr.segments == pr.packed.segments
    assert pr.scale == 0.5 and pr.dropout_p == 0.25 and pr.varlen_kernel == "grouped" and pr.kv_valid_len is None

    bm = random_mask(1, H, T)
    with GatherCount() as agreed:
        pr = bind(q, g, "torus_attention", "torus", kv_valid_len=S - 3, block_mask=bm, block_size=BS)
        pr.source.bind(q, q, q, g, what="torus_attention", mode="torus")   # the same problem again: agreed
    assert torch.equal(pr.block_mask, bm) and pr.block_size == BS and pr.mask_seq_len == S
    assert pr.kv_valid_len == S - 3 and agreed.calls == 1
    assert pr.mask_on(torch.device("cpu")) is pr.mask_on(torch.device("cpu"))   # moved once per problem
    with pytest.raises(AttributeError):   # a value: fields cannot be set
        pr.causal = True
    return True


def test_problem_fields():
    assert run_ranks(_fields, 2, timeout=60) == [True, True]


# ------------------------------------------------------------------------------------------ bound once per call
PUBLIC = {"ulysses_attention": function.ulysses_attention, "ring_attention": ring.ring_attention,
          "hybrid_attention": hybrid.hybrid_attention, "torus_attention": torus.torus_attention}
# what only the builder may do: these calls (and ``layout == ...`` branches) do not appear in a public function
PREAMBLE_CALLS = {"check_inputs", "check_ring_inputs", "check_tile_mask", "check_mask_once", "packed_cu",
                  "valid_kv_len", "get_backend", "check_p2p", "checked_mask", "_packed_samples"}


def _problem_scan(source: str) -> list:
    """What is wrong with a public function's source: its first statement after the docstring takes the problem (or
    builds it from the keywords: ``problem_from_keywords``), it binds it once (``.bind(...)``), and it neither runs
    a preamble check itself nor branches on the layout."""
    fn = ast.parse(textwrap.dedent(source)).body[0]
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    wrong = []
    first = body[0] if body else None
    call = first.value if isinstance(first, (ast.Assign, ast.Expr)) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "problem_from_keywords"):
        wrong.append("first statement is not problem_from_keywords(...)")
    calls = [n.func for n in ast.walk(fn) if isinstance(n, ast.Call)]
    names = [f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "" for f in calls]
    if names.count("bind") != 1:
        wrong.append(f"bind called {names.count('bind')} times")
    wrong += [f"calls {n}" for n in names if n in PREAMBLE_CALLS]
    wrong += [f"branches on layout (line {n.lineno})" for n in ast.walk(fn) if isinstance(n, ast.Compare)
              and "layout" in ast.unparse(n.left)]
    return wrong


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_function_binds_its_problem_once(name):
    assert _problem_scan(inspect.getsource(PUBLIC[name])) == [], name


def test_the_scan_finds_a_preamble():
    bad = '''
def f(q, k, v, group, problem=None, **kw):
    """doc"""
    check_inputs(q, k, v, layout, group)
    s = q.shape[1] if layout == "bshd" else q.shape[0]
    pr = problem.bind(q, k, v, group)
    return pr
'''
    assert _problem_scan(bad) == ["first statement is not problem_from_keywords(...)", "calls check_inputs",
                                  "branches on layout (line 5)"]
    two = 'def g(q):\n    """doc"""\n    p, _ = problem_from_keywords("g", None, {})\n    p.bind(q)\n    return p.bind(q)\n'
    assert _problem_scan(two) == ["bind called 2 times"]


# ---------------------------------------------------------------------------------- one agreement per problem
def _once_per_problem(rank, world):
    """Each public function, one problem (with a block mask) built once: the first call agrees it across ranks (one
    all_gather), 4 more calls with the same problem do no all_gather at all, and a new problem (a new mask) costs
    its one agreement. Outputs and gradients match the float64 masked reference."""
    g = dist.group.WORLD
    mesh = spx.build_sp_mesh(g, num_heads=H, placement="tas", ulysses_size=world, nodes=world)
    calls = {"ulysses_attention": lambda p: lambda q, k, v: spx.ulysses_attention(q, k, v, g, p),
             "ring_attention": lambda p: lambda q, k, v: spx.ring_attention(q, k, v, g, p),
             "hybrid_attention": lambda p: lambda q, k, v: spx.hybrid_attention(q, k, v, mesh, p),
             "torus_attention": lambda p: lambda q, k, v: spx.torus_attention(q, k, v, mesh, p)}
    out = {}
    for i, (name, make) in enumerate(calls.items()):
        mask = random_mask(10 + i, H, T, keep=0.5)
        problem = pb.AttentionProblem(causal=True, block_mask=mask, tile=BS)
        case = dict(s=S, h=H, hkv=H, d=D, bs=BS, causal=True)
        with GatherCount() as first:
            check_case(make(problem), rank, world, block_mask=mask, seed=i, **case)
        with GatherCount() as same:
            for j in range(4):
                check_case(make(problem), rank, world, block_mask=mask, seed=20 + j, **case)
        new = random_mask(30 + i, H, T, keep=0.5)
        fresh_problem = pb.AttentionProblem(causal=True, block_mask=new, tile=BS)
        with GatherCount() as fresh:
            check_case(make(fresh_problem), rank, world, block_mask=new, seed=40 + i, **case)
            check_case(make(fresh_problem), rank, world, block_mask=new, seed=50 + i, **case)
        out[name] = (first.calls, same.calls, fresh.calls)
    return out


def test_a_problem_is_agreed_across_ranks_once():
    for res in run_ranks(_once_per_problem, 2, timeout=120):
        for name, (first, same, fresh) in res.items():
            assert first == 1 and same == 0 and fresh == 1, (name, res[name])
