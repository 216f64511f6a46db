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


def test_links_option_sets_the_regime_and_refuses_bad_values(monkeypatch):
    import argparse

    import pytest

    from tools.gpu_ranks import LINKS_ENV, links_option, transports_for_links
    for var in ("NCCL_P2P_DISABLE", LINKS_ENV, "SPX_EMULATED_MACHINE_SIZE", "SPX_LINKS_PROBE_DIR"):
        monkeypatch.setenv(var, "")  # recorded, so the regime set below is undone after the test
        monkeypatch.delenv(var)
    ap = argparse.ArgumentParser()
    links_option(ap)
    assert ap.parse_args([]).links == "nvlink" and "NCCL_P2P_DISABLE" not in __import__("os").environ
    assert transports_for_links(["nccl", "symm_mem", "copy_engine"]) == ["nccl", "symm_mem", "copy_engine"]
    import os
    assert ap.parse_args(["--links", "emu2"]).links == "emu2" and os.environ["SPX_EMULATED_MACHINE_SIZE"] == "2"
    assert ap.parse_args(["--links", "host"]).links == "host" and os.environ["NCCL_P2P_DISABLE"] == "1"
    assert os.environ[LINKS_ENV] == "host"
    assert transports_for_links(["nccl", "symm_mem", "copy_engine"]) == ["nccl"]
    for bad, msg in (("pcie", "--links 'pcie' is invalid"), ("nvlink", "NCCL_P2P_DISABLE=1 is set"),
                     ("emu0", "is invalid")):
        with pytest.raises(SystemExit):
            ap.parse_args(["--links", bad])
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            ap._option_string_actions["--links"].type(bad)


def _probe(rank, world, probe_dir):
    import torch

    import tools.gpu_ranks as gr
    got = gr.probe_links(__import__("torch.distributed", fromlist=["x"]).group.WORLD, torch.device("cpu"),
                         sizes=(4096, 65536))
    assert got["world"] == 4 and [r["bytes"] for r in got["world_rows"]] == [4096, 65536]
    assert got["world_transport"] == "two_level"
    assert got["intra_machine"]["transport"] == "nccl" and got["intra_machine"]["ranks"] == 2
    assert got["inter_machine"]["transport"] == "host_staged" and got["inter_machine"]["ranks"] == 2
    assert all(r["ms"] > 0 and r["GBps_per_gpu"] > 0 for k in ("intra_machine", "inter_machine")
               for r in got[k]["rows"])
    return True


def test_probe_links_measures_intra_and_inter_machine_exchanges(monkeypatch, tmp_path):
    from tests.harness import run_ranks
    monkeypatch.setenv("SPX_LINKS", "emu2")
    monkeypatch.setenv("SPX_EMULATED_MACHINE_SIZE", "2")
    run_ranks(_probe, 4, str(tmp_path))
