"""The host-staged transport (comm/host_staged.py) and the emulated machines (topology/emulate.py) on CPU.

The transport's CPU path runs the very op list of ``signal_schedule`` (whose protocol is simulated in
tests/test_signal_schedule.py) over shared-memory slots and flags, so its data path is tested here
bit for bit against gloo's all_to_all_single: uneven tables with empty segments, more exchanges than
slots (slot reuse), workspace growth, bf16/fp32, and Ulysses/HCMS/the async block through it. A peer
that skips an exchange makes the waiting rank fail with a clear error (never a hang).
"""
import pytest
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.comm.host_staged import HostStagedTransport, ring_table
from megatron_sp_ext.comm.host_staged import TwoLevelTransport
from megatron_sp_ext.comm.transport import (NcclTransport, TransportPool, default_transports, p2p_disabled_reason,
                                            symm_mem_unavailable_reason)
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.layers.async_qkv import async_ulysses_self_attention
from megatron_sp_ext.sp.layers.call import LayerWeights
from megatron_sp_ext.topology.detect import detect_topology
from megatron_sp_ext.topology.emulate import MACHINE_SIZE_ENV, link_transport, spans_machines
from tests.harness import RankFailure, run_ranks


def _exchanges(rank, world, slots, dtype):
    import datetime
    g = dist.group.WORLD
    tr = HostStagedTransport(g, torch.device("cpu"), slots=slots, timeout=datetime.timedelta(seconds=30))
    gen = torch.Generator().manual_seed(7)             # tables: the same on every rank
    data = torch.Generator().manual_seed(100 + rank)   # payloads: rank-specific
    n_ex = 2 * slots + 3
    for n in range(n_ex):
        scale = 1 if n < n_ex // 2 else 300_000  # the second half grows the workspace past 1 MiB
        table = (torch.randint(0, 4, (world, world), generator=gen) * scale).tolist()
        table[n % world][(n + 1) % world] = 0                    # an empty segment
        send = torch.randn(sum(table[rank]), generator=data).to(dtype)
        send_splits = table[rank]
        recv_splits = [table[r][rank] for r in range(world)]
        want = torch.empty(sum(recv_splits), dtype=dtype)
        dist.all_to_all_single(want, send, recv_splits, send_splits, group=g)
        got = torch.full((sum(recv_splits),), float("nan"), dtype=dtype)
        tr.all_to_all(send, got, send_splits, recv_splits, table=table)
        assert torch.equal(got, want), f"exchange {n} (slots={slots}) differs from gloo's all_to_all"
    # one ring step through the same transport: rank r's data lands on r + 1
    x = torch.full((5,), float(rank), dtype=dtype)
    t = ring_table(world, 5)
    out = torch.empty(5, dtype=dtype)
    tr.all_to_all(x, out, t[rank], [t[r][rank] for r in range(world)], table=t)
    assert torch.equal(out, torch.full((5,), float((rank - 1) % world), dtype=dtype))
    tr.close()
    return True


@pytest.mark.parametrize("world,slots,dtype", [(2, 1, torch.float32), (3, 2, torch.bfloat16), (4, 2, torch.float32)])
def test_host_staged_exchange_is_bitwise_all_to_all(world, slots, dtype):
    run_ranks(_exchanges, world, slots, dtype)


def _ulysses_same(rank, world, h, hkv, chunks, causal):
    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(1, 4 * world, n, 8, generator=gen) for n in (h, hkv, hkv, h)]
    q0, k0, v0, go = (t[:, 4 * rank:4 * rank + 4].contiguous() for t in full)
    outs = []
    for transport in ("nccl", "host_staged"):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        o = spx.ulysses_attention(q, k, v, g, head_chunks=chunks, causal=causal, transport=transport)
        o.backward(go)
        outs.append((o.detach(), q.grad, k.grad, v.grad))
    for name, a, ref in zip(("out", "dq", "dk", "dv"), outs[1], outs[0]):
        assert torch.equal(a, ref), f"{name} differs through host_staged (C={chunks}, H={h}/{hkv})"
    return True


@pytest.mark.parametrize("world,h,hkv,chunks,causal", [
    (2, 4, 4, 2, True), (4, 6, 6, 1, False),   # uneven heads 2,2,1,1
    (4, 8, 2, 2, False)])                      # GQA with kv < P
def test_ulysses_through_host_staged_is_bitwise(world, h, hkv, chunks, causal):
    run_ranks(_ulysses_same, world, h, hkv, chunks, causal)


def _async_same(rank, world):
    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(5)
    h, hkv, d, dim, b, sl = 4, 2, 8, 24, 1, 4
    w_qkv = torch.randn((h + 2 * hkv) * d, dim, generator=gen) * 0.2
    w_o = torch.randn(dim, h * d, generator=gen) * 0.2
    x0, dy = torch.randn(b, sl, dim, generator=gen), torch.randn(b, sl, dim, generator=gen)

    def prep(branch, y, w):
        return y.view(b, sl, h if branch == "q" else hkv, d)
    res = []
    for transport in ("nccl", "host_staged"):
        x, wq, wo = (t.clone().requires_grad_() for t in (x0, w_qkv, w_o))
        y = async_ulysses_self_attention(x, LayerWeights(wq, wo), g, num_heads=h, num_kv_heads=hkv, prep=prep,
                                         head_chunks=2, transport=transport)
        y.backward(dy)
        res.append((y.detach(), x.grad, wq.grad, wo.grad))
    for name, a, ref in zip(("out", "dx", "dW_qkv", "dW_o"), res[1], res[0]):
        assert torch.equal(a, ref), f"async block {name} differs through host_staged"
    return True


def test_async_block_through_host_staged_is_bitwise():
    run_ranks(_async_same, 2)


def _peer_skips(rank, world):
    import datetime
    tr = HostStagedTransport(dist.group.WORLD, torch.device("cpu"), timeout=datetime.timedelta(seconds=2))
    x = torch.ones(world * 3)
    tr.all_to_all(x, torch.empty_like(x))
    if rank == 0:  # rank 1 never issues the second exchange
        with pytest.raises(RuntimeError, match="rank 0 waited 2s for READY"):
            tr.all_to_all(x, torch.empty_like(x))
    return True


def test_a_missing_peer_is_a_clear_error_not_a_hang():
    run_ranks(_peer_skips, 2, timeout=60)


def _emulated(rank, world):
    g = dist.group.WORLD
    topo = detect_topology(g)
    assert (topo.nodes, topo.per_node, topo.node_of, topo.simulated) == (2, 2, (0, 0, 1, 1), True)
    mesh = spx.build_sp_mesh(g, num_heads=4, placement="tas")  # TAS needs >1 machine: it sees 2
    assert mesh.topology.nodes == 2
    intra = dist.new_group([0, 1]), dist.new_group([2, 3])
    cross = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine_intra, mine_cross = intra[rank // 2], cross[rank % 2]
    assert link_transport(mine_intra) == "nccl" and not spans_machines(mine_intra)
    assert link_transport(mine_cross) == "host_staged" and link_transport(g) == "host_staged"
    # a cross-machine group's exchange through the transport the emulation names for it
    tr = TransportPool().get(link_transport(mine_cross), mine_cross, torch.device("cpu"))
    x = torch.arange(4.0) + 10 * rank
    out = torch.empty(4)
    tr.all_to_all(x, out)
    me, members = rank // 2, (rank % 2, rank % 2 + 2)    # my rank in the cross group, its global ranks
    want = torch.cat([(torch.arange(4.0) + 10 * src)[2 * me:2 * me + 2] for src in members])
    assert torch.equal(out, want)
    return True


def test_emulated_machines_are_seen_as_machines(monkeypatch):
    monkeypatch.setenv(MACHINE_SIZE_ENV, "2")
    run_ranks(_emulated, 4)


def _bad_size(rank, world):
    with pytest.raises(SPConfigError, match=f"{MACHINE_SIZE_ENV}=3 does not divide the world size 4"):
        detect_topology(dist.group.WORLD)
    return True


def test_emulated_machine_size_must_divide_the_world(monkeypatch):
    monkeypatch.setenv(MACHINE_SIZE_ENV, "3")
    run_ranks(_bad_size, 4)


def test_slow_link_regime_refuses_copy_engine_transports(monkeypatch):
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    assert p2p_disabled_reason() is None
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert "NCCL_P2P_DISABLE=1" in symm_mem_unavailable_reason(None, torch.device("cuda", 0))
    for name in ("symm_mem", "copy_engine"):
        with pytest.raises(SPConfigError, match=f"--sp-transport='{name}'.*NCCL_P2P_DISABLE=1 is set"):
            TransportPool().get(name, None, torch.device("cuda", 0), "--sp-transport")


def _two_level(rank, world, node_of):
    g = dist.group.WORLD
    tr = TwoLevelTransport(g, torch.device("cpu"), node_of)
    gen, data = torch.Generator().manual_seed(11), torch.Generator().manual_seed(200 + rank)
    for n in range(6):
        table = torch.randint(0, 5, (world, world), generator=gen).tolist()
        table[n % world][(n + 2) % world] = 0
        send = torch.randn(sum(table[rank]), generator=data)
        ss, rs = table[rank], [table[r][rank] for r in range(world)]
        want = torch.empty(sum(rs))
        dist.all_to_all_single(want, send, rs, ss, group=g)
        got = torch.full((sum(rs),), float("nan"))
        w = tr.all_to_all(send, got, ss, rs, async_op=n % 2 == 1, table=table)
        if w is not None:
            w.wait()
        assert torch.equal(got, want), f"two-level exchange {n} differs (machines {node_of})"
    return True


@pytest.mark.parametrize("world,node_of", [(4, (0, 0, 1, 1)), (6, (0, 0, 0, 1, 1, 1)), (3, (0, 1, 2))])
def test_two_level_exchange_is_bitwise_all_to_all(world, node_of):
    run_ranks(_two_level, world, node_of)


def _ulysses_emulated(rank, world, h, chunks, causal):
    g = dist.group.WORLD
    assert default_transports().get("nccl", g, torch.device("cpu")).name == "two_level"  # the emulation's link
    gen = torch.Generator().manual_seed(4)
    full = [torch.randn(1, 4 * world, h, 8, generator=gen) for _ in range(4)]
    q0, k0, v0, go = (t[:, 4 * rank:4 * rank + 4].contiguous() for t in full)
    outs = []
    for transport in (NcclTransport(g), "nccl"):  # the group's own all_to_all vs the emulated two levels
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        o = spx.ulysses_attention(q, k, v, g, head_chunks=chunks, causal=causal, transport=transport)
        o.backward(go)
        outs.append((o.detach(), q.grad, k.grad, v.grad))
    for name, a, ref in zip(("out", "dq", "dk", "dv"), outs[1], outs[0]):
        assert torch.equal(a, ref), f"{name} differs under the emulated machines"
    # the mesh modes see the machines: TAS puts Ulysses across them (two-level), USP inside (plain)
    tas = spx.build_sp_mesh(g, num_heads=h, placement="tas", ulysses_size=2)
    usp = spx.build_sp_mesh(g, num_heads=h, placement="usp", ulysses_size=2)
    dev = torch.device("cpu")
    assert default_transports().get("nccl", tas.ulysses_group, dev).name == "two_level"
    assert default_transports().get("nccl", usp.ulysses_group, dev).name == "nccl"
    return True


@pytest.mark.parametrize("h,chunks,causal", [(8, 2, False), (6, 1, True)])
def test_ulysses_under_emulated_machines_is_bitwise(monkeypatch, h, chunks, causal):
    monkeypatch.setenv(MACHINE_SIZE_ENV, "2")
    run_ranks(_ulysses_emulated, 4, h, chunks, causal)


def _mesh_modes_emulated(rank, world, causal):
    import os
    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(9)
    h, d, s_loc = 4, 8, 4
    full = [torch.randn(1, s_loc * world, h, d, generator=gen) for _ in range(4)]
    placement = "zigzag" if causal else "contiguous"
    q0, k0, v0, go = (spx.shard_sequence(t, g, placement=placement) for t in full)
    meshes = {}

    from megatron_sp_ext.comm import transport as T

    def link_exchanges():
        return sum(t.inter._epoch for t in T._EMULATED.values())

    crossings = {}

    def runs():
        out = {}
        for name in ("ring", "tasp", "usp", "tas", "torus"):
            before = link_exchanges()
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            if name in ("ring", "tasp"):
                o = spx.ring_attention(q, k, v, g, variant=name, causal=causal, placement=placement if name == "ring"
                                       else "contiguous") if not (causal and name == "tasp") else None
                if o is None:
                    continue
            else:
                placement_of_mesh = "tas" if name == "torus" else name  # torus: its staged Ulysses crosses machines
                if placement_of_mesh not in meshes:
                    meshes[placement_of_mesh] = spx.build_sp_mesh(g, num_heads=h, placement=placement_of_mesh,
                                                                  ulysses_size=2, nodes=2)
                mesh = meshes[placement_of_mesh]
                o = (spx.torus_attention(q, k, v, mesh, causal=causal, placement=spx.balanced_placement("ring",
                                         causal)) if name == "torus"
                     else spx.hybrid_attention(q, k, v, mesh, causal=causal, placement=spx.balanced_placement("ring",
                                               causal)))
            o.backward(go)
            out[name] = (o.detach(), q.grad, k.grad, v.grad)
            crossings[name] = link_exchanges() - before
        return out
    os.environ.pop(MACHINE_SIZE_ENV, None)
    plain = runs()
    os.environ[MACHINE_SIZE_ENV] = "2"  # from here every group crossing {0,1} | {2,3} goes through the emulation
    emulated = runs()
    # every mode's traffic between the emulated machines takes the link: the ring hops of ring, tasp and usp
    # (ring across machines), the Ulysses exchanges of tas and the staged ones of torus (Ulysses across machines)
    for name, n in crossings.items():
        assert n > 0, f"{name}: no exchange went through the emulated inter-machine link"
    assert set(plain) == set(emulated) and len(plain) >= 4
    for name in plain:
        for what, a, ref in zip(("out", "dq", "dk", "dv"), emulated[name], plain[name]):
            assert torch.equal(a, ref), f"{name} {what} differs under the emulated machines (causal={causal})"
    return True


@pytest.mark.parametrize("causal", [False, True])
def test_ring_and_mesh_modes_under_emulated_machines_are_bitwise(causal):
    run_ranks(_mesh_modes_emulated, 4, causal)
