"""tools/benchlib.py (the bench scripts' harness), on CPU: launch under spawn and under torchrun's environment,
the end of a worker, interleaved timing (rotation, median, max over ranks), results and plot-or-skip."""
import json
import os

import pytest
import torch.distributed as dist

from tools import benchlib


def _worker(rank, world, port, args, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ms = {"a": [float(rank + 1), 9.0, 2.0], "b": [5.0, float(10 * rank), 7.0]}
    med = benchlib.median_max(ms, dist.group.WORLD, "cpu")
    order = []
    got, = benchlib.interleaved_ms([{n: (lambda n=n: order.append(n)) for n in "xyz"}], 3, dist.group.WORLD,
                                   clock="wall", device="cpu")
    benchlib.finish_worker(rank, path, {"P": world, "tag": args["tag"], "median_max": med, "order": order,
                                        "timed": sorted(got)})


def test_launch_spawns_each_world_size_and_ends_workers(tmp_path):
    got = benchlib.launch(_worker, [1, 2, 3], {"tag": "t"}, str(tmp_path), "s", max_world=2)
    assert [g["P"] for g in got] == [1, 2] and all(g["tag"] == "t" for g in got)
    # medians per rank: a = [2, 2] (rank 0: 1,9,2 -> 2; rank 1: 2,9,2 -> 2), b = [5, 7] -> max over ranks
    assert got[0]["median_max"] == {"a": 2.0, "b": 5.0} and got[1]["median_max"] == {"a": 2.0, "b": 7.0}
    assert got[1]["order"] == list("xyz") + list("yzx") + list("zxy")  # each fn leads once
    assert got[1]["timed"] == list("xyz")
    assert list(tmp_path.iterdir()) == []


def test_launch_under_torchrun_runs_this_process_as_one_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    from tools.gpu_ranks import free_port
    port = free_port()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    got = benchlib.launch(_worker, [4, 8], {"tag": "tr"}, str(tmp_path), "s")  # world sizes: torchrun's, not these
    assert [g["P"] for g in got] == [1] and got[0]["tag"] == "tr"
    assert not dist.is_initialized() and list(tmp_path.iterdir()) == []


def test_results_and_plot_or_skip(tmp_path, capsys):
    meta = benchlib.run_meta(x=1)
    assert {"date", "device", "command", "commit"} <= set(meta) and meta["x"] == 1
    path = benchlib.write_results(str(tmp_path / "o"), "r", {"meta": meta, "rows": [1]}, ["| a |", "|---|"])
    assert json.load(open(path))["rows"] == [1]
    assert (tmp_path / "o" / "r.md").read_text() == "| a |\n|---|\n" and "| a |" in capsys.readouterr().out
    pytest.importorskip("matplotlib")

    def draw(plt):
        fig, ax = plt.subplots()
        ax.plot([0, 1], [1, 0])
        return fig
    assert benchlib.plot_or_skip(str(tmp_path / "p.png"), draw) and (tmp_path / "p.png").stat().st_size > 0

    def broken(plt):
        raise ValueError("no data")
    assert not benchlib.plot_or_skip(str(tmp_path / "q.png"), broken, "who")
    assert "[who] plot skipped: no data" in capsys.readouterr().out and not (tmp_path / "q.png").exists()


def test_init_world_high_priority_sets_nccls_option(monkeypatch):
    """init_world(high_priority=True): NCCL's process group made with is_high_priority_stream=True (bench_cp
    --nccl-priority high, the SM-starvation check of the ring's forward); refused by name for gloo."""
    from tools import benchlib
    calls = []

    class Options:   # stands in for ProcessGroupNCCL.Options (a CPU build of torch has no NCCL)
        def __init__(self, is_high_priority_stream=False):
            self.is_high_priority_stream = is_high_priority_stream
    monkeypatch.setattr(benchlib.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(benchlib.torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(benchlib.dist, "ProcessGroupNCCL", type("PG", (), {"Options": Options}), raising=False)
    monkeypatch.setattr(benchlib.dist, "init_process_group", lambda b, **kw: calls.append((b, kw)))
    monkeypatch.setattr(benchlib.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(benchlib.dist, "get_world_size", lambda: 2)
    benchlib.init_world("nccl", high_priority=True)
    benchlib.init_world("nccl")
    assert calls[0][1]["pg_options"].is_high_priority_stream is True and "pg_options" not in calls[1][1]
    for bad in (dict(backend="gloo"), dict(share_gpu=True)):
        with pytest.raises(ValueError, match="high_priority is an option of NCCL"):
            benchlib.init_world(high_priority=True, **bad)
