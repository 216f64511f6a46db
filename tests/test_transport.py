"""Exchange transports: the copy-engine (symmetric-memory) pull schedule and the stream-ordered path
of Ulysses/HCMS and the async block, on CPU.

The CUDA transport cannot run on gloo, so its two halves are tested separately:
  * ``pull_all_to_all`` (the indexing of every pull, even and uneven splits) against a reference
    all-to-all, with simulated peer buffers;
  * ``PulledGlooTransport`` below has the same contract as SymmMemTransport (stream-ordered, one
    reused workspace that callers pack into, pulls through ``pull_all_to_all``), with the peers'
    workspaces fetched by a gloo all_gather. Ulysses, HCMS and the async block must give results
    bit-identical to the NCCL/gloo transport through it. The workspace is poisoned after every
    exchange, so a caller that reads a send buffer after its exchange fails the test.
The symm_mem / copy_engine transports were checked on GPUs by the retired tools/gpu_check.py (results in
results/README.md); the CUDA suite (tests/gpu/test_cuda.py) does not run them yet.
"""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.comm.transport import TransportPool, pull_all_to_all
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.layers.async_qkv import async_ulysses_self_attention
from megatron_sp_ext.sp.layers.call import LayerWeights
from tests.harness import run_ranks


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pull_schedule_matches_all_to_all(world):
    gen = torch.Generator().manual_seed(world)
    table = torch.randint(0, 5, (world, world), generator=gen).tolist()
    table[0][world - 1] = 0  # an empty segment
    sends = [torch.randn(sum(table[r]) + 3, generator=gen) for r in range(world)]  # + slack past the data
    for me in range(world):
        expected = torch.cat([sends[r][sum(table[r][:me]):sum(table[r][:me + 1])] for r in range(world)])
        recv = torch.full((expected.numel(),), float("nan"))
        order = []

        def copy(peer, dst, src):
            order.append(peer)
            dst.copy_(src)
        pull_all_to_all(me, world, table, recv, sends[me], lambda r: sends[r], copy)
        assert torch.equal(recv, expected)
        nonempty = [(me + s) % world for s in range(world) if table[(me + s) % world][me] > 0]
        assert order == nonempty  # own segment first, then peers from me+1 on


class PulledGlooTransport:
    """SymmMemTransport's contract on gloo (see module docstring)."""

    name = "pulled_gloo"
    stream_ordered = True

    def __init__(self, group):
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.buf = torch.empty(0)
        self.exchanges = 0

    def _ensure(self, numel, dtype):
        size = torch.tensor([numel])
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self.group)
        if self.buf.numel() < int(size) or self.buf.dtype != dtype:
            self.buf = torch.full((int(size),), float("nan"), dtype=dtype)

    def send_buffer(self, numel, like):
        self._ensure(numel, like.dtype)
        return self.buf[:numel]

    def all_to_all(self, send, recv, send_splits=None, recv_splits=None, async_op=False, table=None):
        if send_splits is None:
            send_splits = [send.numel() // self.world] * self.world
        rows = [torch.empty(self.world, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(rows, torch.tensor(list(send_splits)), group=self.group)
        true_table = [r.tolist() for r in rows]
        if table is None:  # the CUDA transport accepts no table only for even exchanges
            assert len({n for row in true_table for n in row}) == 1, "uneven exchange without a table"
            table = true_table
        assert [list(r) for r in table] == true_table, "the caller's split table is wrong"
        staged = send.data_ptr() == self.buf.data_ptr()
        if not staged:
            self._ensure(max(sum(r) for r in table), send.dtype)
            self.buf[:send.numel()].copy_(send)
        else:
            self._ensure(max(sum(r) for r in table), send.dtype)
        peers = [torch.empty_like(self.buf) for _ in range(self.world)]
        dist.all_gather(peers, self.buf, group=self.group)  # "barrier" + mapping of the peers' workspaces
        pull_all_to_all(self.rank, self.world, table, recv, self.buf, peers.__getitem__,
                        lambda r, dst, src: dst.copy_(src))
        self.buf.fill_(float("nan"))  # the next exchange may reuse it: nobody may read it any more
        self.exchanges += 1
        return None


def _qkv(rank, world, b, s, h, hkv, d, dtype, seed=3):
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(b, s * world, n, d, generator=gen).to(dtype) for n in (h, hkv, hkv)]
    go = torch.randn(b, s * world, h, d, generator=gen).to(dtype)
    mine = slice(rank * s, (rank + 1) * s)
    return [t[:, mine].clone() for t in full], go[:, mine].clone()


def _ulysses_same(rank, world, h, hkv, chunks, causal, layout, contiguous):
    g = dist.group.WORLD
    (q0, k0, v0), go = _qkv(rank, world, 2, 5, h, hkv, 8, torch.float32)
    tr = PulledGlooTransport(g)
    outs = []
    for transport in ("nccl", tr):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        args = [t if layout == "bshd" else t.transpose(0, 1) for t in (q, k, v)]
        o = spx.ulysses_attention(*args, g, head_chunks=chunks, causal=causal, layout=layout,
                                  qkv_contiguous=contiguous, transport=transport)
        o = o if layout == "bshd" else o.transpose(0, 1)
        o.backward(go)
        outs.append((o.detach(), q.grad, k.grad, v.grad))
    assert tr.exchanges > 0
    for name, a, ref in zip(("out", "dq", "dk", "dv"), outs[1], outs[0]):
        assert torch.equal(a, ref), f"{name} differs through the pulled transport (C={chunks}, H={h}/{hkv})"
    return True


@pytest.mark.parametrize("world,h,hkv,chunks,causal,layout,contiguous", [
    (2, 4, 4, 1, False, "bshd", True), (2, 4, 4, 2, True, "bshd", True), (4, 8, 8, 2, False, "sbhd", True),
    (4, 6, 6, 1, True, "bshd", True),     # uneven heads: 2,2,1,1 per rank -> uneven splits
    (4, 8, 2, 2, False, "bshd", True),    # GQA with kv < P (replicated kv heads)
    (3, 9, 3, 3, True, "sbhd", False),    # packed q|k|v variant, three chunks
    (3, 8, 8, 2, False, "sbhd", False)])  # uneven heads (3,3,2) and chunks (2+1), packed gradients
def test_stream_ordered_transport_is_bitwise_identical(world, h, hkv, chunks, causal, layout, contiguous):
    run_ranks(_ulysses_same, world, h, hkv, chunks, causal, layout, contiguous)


def _async_same(rank, world, h, hkv, chunks):
    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(5)
    d, dim, b, sl = 8, 24, 1, 4
    w_qkv = torch.randn((h + 2 * hkv) * d, dim, generator=gen) * 0.2
    w_o = torch.randn(dim, h * d, generator=gen) * 0.2
    x0 = torch.randn(b, sl, dim, generator=gen)
    dy = torch.randn(b, sl, dim, generator=gen)

    def prep(branch, y, w):
        return y.view(b, sl, h if branch == "q" else hkv, d)
    tr = PulledGlooTransport(g)
    res = []
    for transport in ("nccl", tr):
        x, wq, wo = (t.clone().requires_grad_() for t in (x0, w_qkv, w_o))
        y = async_ulysses_self_attention(x, LayerWeights(wq, wo), g, num_heads=h, num_kv_heads=hkv, prep=prep,
                                         head_chunks=chunks, transport=transport)
        y.backward(dy)
        res.append((y.detach(), x.grad, wq.grad, wo.grad))
    for name, a, ref in zip(("out", "dx", "dW_qkv", "dW_o"), res[1], res[0]):
        assert torch.equal(a, ref), f"async block {name} differs through the pulled transport"
    return True


@pytest.mark.parametrize("world,h,hkv,chunks", [(2, 4, 2, 2), (4, 6, 6, 1)])
def test_async_block_stream_ordered_transport(world, h, hkv, chunks):
    run_ranks(_async_same, world, h, hkv, chunks)


def _symm_mem_on_gloo(rank, world):
    q = torch.randn(1, 2, 4, 8)
    for setting in ("transport", "--sp-transport", "sequence_parallel_ext.transport"):
        with pytest.raises(SPConfigError, match=f"{setting}='symm_mem' .*needs CUDA tensors.*use 'nccl'"):
            TransportPool().get("symm_mem", dist.group.WORLD, q.device, setting)
    with pytest.raises(SPConfigError, match="transport='symm_mem' .*cannot run here"):
        spx.ulysses_attention(q, q, q, dist.group.WORLD, transport="symm_mem")
    for setting in ("transport", "--sp-transport", "sequence_parallel_ext.transport"):
        with pytest.raises(SPConfigError, match=f"{setting}='copy_engine' .*needs CUDA tensors.*use 'nccl'"):
            TransportPool().get("copy_engine", dist.group.WORLD, q.device, setting)
    with pytest.raises(SPConfigError, match="transport='copy_engine' .*cannot run here"):
        spx.ulysses_attention(q, q, q, dist.group.WORLD, head_chunks=2, transport="copy_engine")
    with pytest.raises(SPConfigError, match="transport='pcie' is invalid: choose one of nccl, symm_mem, copy_engine"):
        spx.ulysses_attention(q, q, q, dist.group.WORLD, transport="pcie")
    return True


def test_symm_mem_on_cpu_is_a_clear_error_not_a_fallback():
    run_ranks(_symm_mem_on_gloo, 2)
