"""Run a function on N ranks over gloo (CPU) with fast fork start-up and short timeouts.

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes; each initialises a gloo
process group on a FileStore, calls ``fn(rank, world_size, *args)`` and reports back. Any rank's
exception is re-raised in the parent as ``RankFailure`` naming the rank and carrying its traceback;
a rank that neither finishes nor fails within ``timeout`` seconds fails the run (no hangs).
Heavy modules are imported in the parent before forking; the parent pins torch to one thread
first (a multi-threaded parent makes forked children hang).
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import traceback

import torch
import torch.distributed as dist

torch.set_num_threads(1)

COLLECTIVE_TIMEOUT_S = float(os.environ.get("SPX_TEST_PG_TIMEOUT", "60"))


class RankFailure(AssertionError):
    """A rank raised or timed out."""


def _child(fn, rank, world, store_path, queue, args, kwargs, backend="gloo", device="cpu"):
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # what torchrun sets (DeepSpeed checks LOCAL_RANK); one simulated machine
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        extra = {}
        if device == "cuda":  # nccl: one rank per GPU; gloo: every rank on GPU 0 (CUDA tensors through host memory)
            dev = torch.device("cuda", rank if backend == "nccl" else 0)
            torch.cuda.set_device(dev)
            os.environ["LOCAL_RANK"] = str(dev.index)  # entry points and DeepSpeed pick their GPU from it
            if backend == "nccl":
                extra["device_id"] = dev
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **extra)
        result = fn(rank, world, *args, **kwargs)
        if dist.is_initialized():
            # a rank that finished early must not close its gloo pairs while a peer is still connecting or
            # reading them ("Connection closed by peer" in connectFullMesh, seen once in CI on a 4-rank test)
            dist.barrier()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything with the rank
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, device: str = "cpu", backend: str = "gloo",
              **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; returns per-rank results.

    device "cpu": forked gloo ranks. device "cuda": spawned ranks (a forked child cannot use CUDA; ``fn`` must
    be importable), each with its current device set: ``backend`` "gloo" puts every rank on GPU 0 (P ranks on
    one GPU, exchanges through host memory), "nccl" one rank per GPU."""
    ctx = mp.get_context("fork" if device == "cpu" else "spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, store_path, queue, args, kwargs, backend,
                                                  device), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results, errors = {}, []
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(results) + len(errors) < world_size:
                left = (deadline - datetime.datetime.now()).total_seconds()
                if left <= 0:
                    break
                try:
                    rank, status, payload = queue.get(timeout=min(left, 1.0))
                except queue_mod.Empty:  # only "nothing yet": a result that cannot be unpickled must fail loudly
                    if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs) and queue.empty():
                        dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
                        errors.append((dead[0], f"rank process exited with code {procs[dead[0]].exitcode}"))
                        break
                    continue
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append((rank, payload))
                    break  # the others will time out or fail too; report the first failure
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            rank, tb = errors[0]
            raise RankFailure(f"rank {rank} of {world_size} failed:\n{tb}")
        if len(results) < world_size:
            missing = sorted(set(range(world_size)) - set(results))
            raise RankFailure(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s")
        return [results[r] for r in range(world_size)]
