"""Shared start-up of the GPU tools: one process per GPU, each joining one NCCL group.

    spawn(worker, world, *args)   # runs worker(rank, world, port, *args) on ranks 0..world-1
    init_nccl_rank(rank, world, port, timeout_s)   # first line of every worker
    run_world_sizes(worker, [2, 4], args, out_dir, stem)   # one spawn per world size, rank 0's JSON back
    run_meta()   # date, device, command line for a result file
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import sys
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


def run_meta(**extra) -> dict:
    """Date, device and the command line of this run (plus ``extra``), for a result file's header."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"date": datetime.date.today().isoformat(), "device": device, "command": " ".join(sys.argv), **extra}
