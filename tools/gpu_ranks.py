"""Shared start-up of the GPU tools: one process per GPU, each joining one NCCL group.

    spawn(worker, world, *args)   # runs worker(rank, world, port, *args) on ranks 0..world-1
    init_nccl_rank(rank, world, port, timeout_s)   # first line of every worker
    run_world_sizes(worker, [2, 4], args, out_dir, stem)   # one spawn per world size, rank 0's JSON back
    run_meta()   # date, device, command line, git commit for a result file (+ the link regime and its probe)
    links_option(ap)   # --links nvlink|host|emu<M>: one line in every benchmark's argument parser

The link regime (``--links``), applied in the parent before any rank starts (spawned ranks inherit it):
  nvlink  the machine as it is (NCCL peer-to-peer over NVLink).
  host    NCCL_P2P_DISABLE=1 for every rank: NCCL exchanges go through host memory (~25-30 GB/s per
          GPU on 4 x H200: PCIe servers, one 400 Gb/s NIC per GPU). Copy-engine transports
          (symm_mem, copy_engine) would bypass it over NVLink: the library refuses them then
          (comm/transport.p2p_disabled_reason), so they leave every candidate list.
  emu<M>  emulated machines of M GPUs (SPX_EMULATED_MACHINE_SIZE=M, topology/emulate.py): topology
          detection sees them, groups that span them exchange through the host-staged transport.
Every rank measures its exchange bandwidth right after joining the NCCL group (``probe_links``, a
few all-to-alls) and the result goes into ``run_meta()``, i.e. into every result JSON.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free local TCP port for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_nccl_rank(rank: int, world: int, port: int, timeout_s: float = 300) -> None:
    """Pin this process to GPU ``rank`` and join the world NCCL group (rendezvous on localhost:port)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank),
                            timeout=datetime.timedelta(seconds=timeout_s))
    if os.environ.get(LINKS_ENV):
        probe = probe_links(dist.group.WORLD, torch.device("cuda", rank))
        out_dir = os.environ.get(PROBE_DIR_ENV)
        if out_dir:   # rank 0 writes; its failure ends every rank rather than leaving them in the bench's collectives
            from training.video_dit.faults import on_rank0  # noqa: PLC0415

            def write() -> None:
                with open(os.path.join(out_dir, f"probe_P{world}.json"), "w") as f:
                    json.dump(probe, f)
            on_rank0(f"writing the links probe to {out_dir}", write, dist.group.WORLD)


def spawn(worker, world: int, *args) -> None:
    """Run ``worker(rank, world, port, *args)`` in ``world`` spawned processes (a fresh port each call)."""
    mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, start_method="spawn")


def run_world_sizes(worker, world_sizes, args, out_dir: str, stem: str, max_world: Optional[int] = None) -> list:
    """For each world size that fits here (``max_world``, default the visible GPUs): spawn
    ``worker(rank, world, port, args, path)``, whose rank 0 writes its JSON result to ``path``, and
    collect those results in order (one entry per world size run). Sizes that do not fit are said and skipped."""
    limit = torch.cuda.device_count() if max_world is None else max_world
    os.makedirs(out_dir, exist_ok=True)
    results = []
    for world in world_sizes:
        if world > limit:
            print(f"[{stem}] P={world} skipped: only {limit} devices", flush=True)
            continue
        path = os.path.join(out_dir, f"_{stem}_P{world}.json")
        spawn(worker, world, args, path)
        with open(path) as f:
            results.append(json.load(f))
        os.remove(path)
    return results


def git_commit() -> Optional[str]:
    """The commit of the checkout these tools run from (None outside git)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_meta(**extra) -> dict:
    """Date, device, the command line and the git commit of this run (plus ``extra``), for a result file's
    header; with ``--links``, the regime and the exchange bandwidth each world size measured (``links_probe``)."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    meta = {"date": datetime.date.today().isoformat(), "device": device, "command": " ".join(sys.argv),
            "commit": git_commit()}
    if os.environ.get(LINKS_ENV):
        meta["links"] = os.environ[LINKS_ENV]
        meta["NCCL_P2P_DISABLE"] = os.environ.get("NCCL_P2P_DISABLE", "0")
        probes = {}
        for path in sorted(glob.glob(os.path.join(os.environ.get(PROBE_DIR_ENV, "/nonexistent"), "probe_P*.json"))):
            with open(path) as f:
                probes[os.path.basename(path)[len("probe_P"):-len(".json")]] = json.load(f)
        meta["links_probe"] = probes
    return {**meta, **extra}


# -- the link regime -------------------------------------------------------------------------------
LINKS_ENV = "SPX_LINKS"                 # the regime this run was started in (set by --links)
PROBE_DIR_ENV = "SPX_LINKS_PROBE_DIR"   # where rank 0 of each world size leaves its probe
LINKS_HELP = ("link regime: nvlink (as the machine is), host (NCCL_P2P_DISABLE=1: exchanges through host memory, "
              "copy-engine transports refused), emu<M> (emulated machines of M GPUs: cross-machine groups "
              "host-staged)")


def apply_links(value: str) -> str:
    """Set the environment of regime ``value`` for this process and the ranks it starts (argparse type)."""
    from megatron_sp_ext.topology.emulate import MACHINE_SIZE_ENV  # noqa: PLC0415
    p2p_off = os.environ.get("NCCL_P2P_DISABLE", "0").strip().lower() in ("1", "true", "yes")
    if value == "nvlink":
        if p2p_off:
            raise argparse.ArgumentTypeError("--links nvlink, but NCCL_P2P_DISABLE=1 is set in the environment: "
                                             "unset it, or use --links host")
    elif value == "host":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    elif value.startswith("emu") and value[3:].isdigit() and int(value[3:]) >= 1:
        if p2p_off:
            raise argparse.ArgumentTypeError(f"--links {value} keeps NVLink inside the emulated machines, but "
                                             f"NCCL_P2P_DISABLE=1 is set in the environment: unset it")
        os.environ[MACHINE_SIZE_ENV] = value[3:]
    else:
        raise argparse.ArgumentTypeError(f"--links {value!r} is invalid: use nvlink, host or emu<M> "
                                         f"(M = GPUs per emulated machine, e.g. emu2)")
    os.environ[LINKS_ENV] = value
    if not os.environ.get(PROBE_DIR_ENV):
        os.environ[PROBE_DIR_ENV] = tempfile.mkdtemp(prefix="spx_links_")
    return value


def links_option(ap: argparse.ArgumentParser) -> None:
    """Add ``--links`` to a benchmark's parser; parsing it applies the regime (also the default)."""
    ap.add_argument("--links", type=apply_links, default="nvlink", help=LINKS_HELP)


def transports_for_links(names) -> list:
    """``names`` without the transports the current regime refuses (copy-engine ones when P2P is off)."""
    from megatron_sp_ext.comm.transport import p2p_disabled_reason  # noqa: PLC0415
    if p2p_disabled_reason() is None:
        return list(names)
    return [n for n in names if n not in ("symm_mem", "copy_engine")]


def time_exchange_ms(tr, nbytes: int, group, device, iters: int = 10) -> float:
    """Median ms of one even all-to-all of ``nbytes`` per rank through transport ``tr`` (max over ranks;
    CUDA events on GPUs, the host clock on CPU)."""
    import time  # noqa: PLC0415
    world = dist.get_world_size(group)
    n = max(world, nbytes // 2 // world * world)
    send = torch.randn(n, device=device).to(torch.bfloat16)
    recv = torch.empty_like(send)
    cuda = device.type == "cuda"

    def once():
        w = tr.all_to_all(send, recv, async_op=True)
        if w is not None:
            w.wait()
    for _ in range(3):
        once()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            once()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            once()
            times.append((time.perf_counter() - t0) * 1e3)
    med = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
    return float(med)


def bandwidth_row(tr, nbytes: int, group, device, iters: int = 10) -> dict:
    """One point of an exchange sweep: bytes per rank, ms, and the per-GPU bus bandwidth (bytes that
    leave the GPU, (P-1)/P of the buffer, per second)."""
    world = dist.get_world_size(group)
    ms = time_exchange_ms(tr, nbytes, group, device, iters)
    return {"bytes": nbytes, "ms": ms, "GBps_per_gpu": nbytes * (world - 1) / world / ms / 1e6}


def link_groups(world: int, machine_size: int) -> tuple:
    """(intra groups, cross groups) of an emulated cluster, created collectively in the same order on
    every rank: intra = the ranks of one machine, cross = the ranks with the same local index."""
    intra = [dist.new_group(list(range(m * machine_size, (m + 1) * machine_size)))
             for m in range(world // machine_size)] if machine_size > 1 else []
    cross = [dist.new_group(list(range(i, world, machine_size))) for i in range(machine_size)] \
        if world // machine_size > 1 else []
    return intra, cross


def probe_links(group, device, sizes=(1 << 22, 1 << 25, 1 << 28)) -> dict:
    """The exchange bandwidth of this regime, measured here (collective): NCCL all-to-all over the
    whole group, and with emulated machines also inside a machine (NCCL) and across (host-staged)."""
    from megatron_sp_ext.comm.transport import default_transports  # noqa: PLC0415
    from megatron_sp_ext.topology.emulate import emulated_machine_size, link_transport  # noqa: PLC0415
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    pool = default_transports()
    whole = pool.get("nccl", group, device)  # two_level when the group spans emulated machines
    out = {"links": os.environ.get(LINKS_ENV), "world": world, "world_transport": whole.name,
           "world_rows": [bandwidth_row(whole, n, group, device) for n in sizes]}
    m = emulated_machine_size()
    if m is not None and world > 1:
        intra, cross = link_groups(world, m)
        for kind, groups, idx in (("intra", intra, rank // m), ("inter", cross, rank % m)):
            if groups:
                g = groups[idx]
                tr = pool.get(link_transport(g), g, device)
                out[f"{kind}_machine"] = {"transport": tr.name, "ranks": world // m if kind == "inter" else m,
                                          "rows": [bandwidth_row(tr, n, g, device) for n in sizes]}
    return out
