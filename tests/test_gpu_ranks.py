"""tools/gpu_ranks.py (the GPU tools' start-up): one spawn per world size that fits, rank 0's JSON back in
order, sizes that do not fit skipped (checked on CPU with a worker that needs no GPU)."""
import json

from tools.gpu_ranks import run_meta, run_world_sizes


def _worker(rank, world, port, args, path):
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"P": world, "port_ok": port > 0, "tag": args["tag"]}, f)


def test_run_world_sizes_collects_rank0_results_and_skips_what_does_not_fit(tmp_path, capsys):
    got = run_world_sizes(_worker, [1, 2, 8], {"tag": "x"}, str(tmp_path), "t", max_world=2)
    assert got == [{"P": 1, "port_ok": True, "tag": "x"}, {"P": 2, "port_ok": True, "tag": "x"}]
    assert "P=8 skipped: only 2 devices" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # the per-world files are removed
    meta = run_meta(extra=1)
    assert meta["extra"] == 1 and {"date", "device", "command"} <= set(meta)
