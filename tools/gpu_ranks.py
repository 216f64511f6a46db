"""Shared start-up of the GPU tools: one process per GPU, each joining one NCCL group.

    spawn(worker, world, *args)   # runs worker(rank, world, port, *args) on ranks 0..world-1
    init_nccl_rank(rank, world, port, timeout_s)   # first line of every worker
"""
from __future__ import annotations

import datetime
import os
import socket

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
