"""Transformer Engine as a peer of tools/bench_cp.py, the parts that are ours (no TE and no GPU here): the --peers
checks and their messages, where TE is found, the TE job's command and environment, the row merge and the ratios to
TE's p2p ring, the fatbin pruning of tools/te_prune.py, and tools/te_install.sh's refusals. TE's own math is not
faked: its rows are checked on the GPU against a full-sequence call (tools/bench_cp_te.py)."""
import importlib.util
import os
import struct
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_sp_ext.errors import SPConfigError
from tools.full_reference import rel_errs, within
from tools.te_peer import (TE_PEERS, add_te_ratios, check_grid, find_te, merge_te_rows, parse_peers, te_command,
                           te_env, te_script_args)
from tools.te_prune import FATBIN_MAGIC, elf_section, prune_fatbin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_peers():
    assert parse_peers("") == []
    assert parse_peers("te") == list(TE_PEERS) == ["te_p2p", "te_a2a", "te_all_gather"]
    assert parse_peers("te_a2a, te_p2p") == ["te_a2a", "te_p2p"]
    with pytest.raises(SPConfigError,
                       match=r"--peers 'te_p2p,te_ring': unknown peer te_ring.*te_p2p, te_a2a, te_all_gather"):
        parse_peers("te_p2p,te_ring")
    with pytest.raises(SPConfigError, match="names a peer twice"):
        parse_peers("te_p2p,te_p2p")


def test_check_grid():
    check_grid([], [3], [7], world=1)   # no peers: nothing to check
    check_grid(["te_p2p", "te_a2a"], [40], [32768, 65536], world=4)
    with pytest.raises(SPConfigError, match=r"--seqlens 1002: .*2 x P = 4 equal chunks; use multiples of 4"):
        check_grid(["te_p2p"], [40], [32768, 1002], world=2)
    with pytest.raises(SPConfigError, match=r"--heads 6 with --peers te_a2a.*P = 4"):
        check_grid(["te_a2a"], [40, 6], [4096], world=4)
    check_grid(["te_p2p"], [6], [4096], world=4)   # only a2a scatters heads
    with pytest.raises(SPConfigError, match="at least 2 ranks"):
        check_grid(["te_p2p"], [40], [4096], world=1)


def test_find_te(tmp_path):
    site = tmp_path / "te_site"
    for d in ("transformer_engine/wheel_lib", "transformer_engine-2.20.2.dist-info",
              "transformer_engine_torch-2.20.2.dist-info"):
        (site / d).mkdir(parents=True)
    (site / "transformer_engine/wheel_lib/transformer_engine_torch.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    assert find_te({"SPX_TE_SITE": str(site)}) == str(site)
    half = str(tmp_path / "half")
    os.makedirs(os.path.join(half, "transformer_engine"))
    with pytest.raises(SPConfigError, match=r"SPX_TE_SITE=.*half lacks transformer_engine-2\.20\.2\.dist-info, "
                                            r"transformer_engine_torch-2\.20\.2\.dist-info, transformer_engine/"
                                            r"wheel_lib/transformer_engine_torch\*\.so.*te_wheels\.sh"):
        find_te({"SPX_TE_SITE": half})
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is importable here: the not-installed message cannot be shown")
    with pytest.raises(SPConfigError, match=r"--peers te_\*: Transformer Engine is not installed.*SPX_TE_SITE is "
                                            r"unset.*tools/te_wheels\.sh.*docs/te_peer\.md"):
        find_te({})


def test_te_env_and_command():
    environ = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1",
               "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_ERROR_FILE": "/e", "PET_NPROC_PER_NODE": "2",
               "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2", "NCCL_P2P_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "0,1",
               "PYTHONPATH": "/tmp/site:/repo:/other"}
    env = te_env(environ, "/tmp/te_site", "/repo")
    assert env["PYTHONPATH"] == "/tmp/te_site:/repo:/tmp/site:/other"
    assert {k: env[k] for k in env if k != "PYTHONPATH"} == {"NCCL_P2P_DISABLE": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert te_env({}, None, "/repo")["PYTHONPATH"] == "/repo"   # TE installed normally: nothing put first
    args = SimpleNamespace(heads="40", seqlens="32768,65536", head_dim=128, causal="no,yes", links="host", iters=5,
                           warmup=2)
    cmd = te_command("/py", 2, "/r/tools/bench_cp_te.py", te_script_args(args, ["te_p2p", "te_a2a"], "/t/te.json"))
    assert cmd == ["/py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "/r/tools/bench_cp_te.py", "--peers", "te_p2p,te_a2a", "--heads", "40", "--seqlens",
                   "32768,65536", "--head-dim", "128", "--causal", "no,yes", "--links", "host", "--iters", "5",
                   "--warmup", "2", "--out-json", "/t/te.json"]


def _row(L, causal, links="nvlink", modes=None, fa4=None):
    return {"P": 2, "H": 40, "L": L, "D": 128, "causal": causal, "links": links,
            "floor": {"fwd": 10.0, "fwd_bwd": 40.0}, "floor_fa4": fa4 or {"error": "not installed"},
            "modes": modes or {}}


def test_merge_and_ratios():
    ours = [_row(32768, False, modes={"ulysses": {"fwd_ms": 12.0, "fwd_bwd_ms": 50.0},
                                      "auto": {"fwd_ms": 11.0, "fwd_bwd_ms": 45.0},
                                      "ring": {"error": "RuntimeError: x"}}, fa4={"fwd": 8.0, "fwd_bwd": 25.0}),
            _row(32768, True, modes={"auto": {"fwd_ms": 6.0, "fwd_bwd_ms": 24.0}})]
    te_doc = {"meta": {}, "rows": [
        _row(32768, False, modes={"te_p2p": {"fwd_ms": 10.0, "fwd_bwd_ms": 50.0, "ok": True},
                                  "te_a2a": {"fwd_ms": 22.0, "fwd_bwd_ms": 60.0, "ok": True}}),
        _row(32768, True, links="host", modes={"te_p2p": {"fwd_ms": 1.0, "fwd_bwd_ms": 1.0}})]}   # other links
    rows = merge_te_rows(ours, te_doc, ["te_p2p", "te_a2a"], why_missing="the TE job exited 1")
    r0, r1 = rows
    assert r0["modes"]["te_p2p"]["ratio_fwd_bwd"] == 50.0 / 40.0 and r0["modes"]["te_a2a"]["ratio_fwd"] == 2.2
    assert r0["modes"]["te_p2p"]["ratio_fa4_fwd_bwd"] == 2.0 and r0["modes"]["te_p2p"]["floor_fa4_fwd_ms"] == 8.0
    assert "ratio_fa4_fwd" not in merge_te_rows([_row(1, False)], {"rows": [_row(1, False, modes={
        "te_p2p": {"fwd_ms": 1.0, "fwd_bwd_ms": 2.0}})]}, ["te_p2p"])[0]["modes"]["te_p2p"]   # FA4 floor not timed
    assert r0["modes"]["auto"]["vs_te_p2p_fwd_bwd"] == 45.0 / 50.0 and r0["modes"]["auto"]["vs_te_p2p_fwd"] == 1.1
    assert r0["modes"]["te_a2a"]["vs_te_p2p_fwd_bwd"] == 60.0 / 50.0
    assert r0["auto_vs_te_p2p"] == {"fwd": 1.1, "fwd_bwd": 0.9}
    assert "vs_te_p2p_fwd" not in r0["modes"]["te_p2p"] and "vs_te_p2p_fwd" not in r0["modes"]["ring"]
    assert r1["modes"]["te_p2p"] == {"error": "the TE job exited 1"} == r1["modes"]["te_a2a"]
    assert "auto_vs_te_p2p" not in r1 and "vs_te_p2p_fwd" not in r1["modes"]["auto"]
    none = merge_te_rows([_row(65536, False)], None, ["te_p2p"])
    assert none[0]["modes"]["te_p2p"] == {"error": "the TE job wrote no row for this shape"}
    assert add_te_ratios(_row(1, False, modes={"te_p2p": {"error": "x"}, "auto": {"fwd_ms": 1, "fwd_bwd_ms": 1}}))[
        "modes"]["auto"] == {"fwd_ms": 1, "fwd_bwd_ms": 1}


def test_rel_errs():
    ref = [torch.ones(2, 3) for _ in range(4)]
    got = [t.clone() for t in ref]
    got[2] = got[2] * 1.5
    errs = rel_errs(got, ref)
    assert errs["out"] == errs["dq"] == errs["dv"] == 0.0 and errs["dk"] == pytest.approx(0.5)
    assert not within(errs) and within({"out": 0.0})
    with pytest.raises(ValueError, match=r"\[out, dq, dk, dv\]"):
        rel_errs(got[:3], ref)


@pytest.mark.parametrize("argv, want", [
    (["--peers", "te_ring"], "bench_cp: --peers 'te_ring': unknown peer te_ring"),
    (["--peers", "te"], "bench_cp: --peers te_*: Transformer Engine is not installed"),
])
def test_bench_cp_refuses_without_traceback(argv, want):
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is importable here")
    env = {k: v for k, v in os.environ.items() if k not in ("SPX_TE_SITE", "RANK", "WORLD_SIZE")}
    env["WORLD_SIZE"] = "2"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_cp.py"), *argv], env=env,
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and want in p.stderr and "Traceback" not in p.stderr, p.stderr


def _fatbin(entries):
    """A fatbin container of (kind, arch, payload) entries, as the CUDA toolchain lays them out."""
    body = b""
    for kind, arch, payload in entries:
        hdr = struct.pack("<HHIQ", kind, 0x101, 64, len(payload)) + bytes(12) + struct.pack("<I", arch)
        body += hdr + bytes(64 - len(hdr)) + payload
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def test_prune_fatbin():
    a, b = _fatbin([(2, 80, b"A" * 24), (2, 90, b"B" * 16)]), _fatbin([(2, 90, b"C" * 8), (2, 120, b"D" * 40)])
    buf = bytearray(b"head" + a + b + b"tail")
    stats = prune_fatbin(buf, 4, len(a) + len(b), keep_arch=90)
    assert dict(stats) == {(2, 80, "zeroed"): 24, (2, 90, "kept"): 24, (2, 120, "zeroed"): 40}
    assert len(buf) == 8 + len(a) + len(b) and buf[:4] == b"head" and buf[-4:] == b"tail"
    assert buf.count(b"B" * 16) == 1 and buf.count(b"C" * 8) == 1 and b"A" not in buf and b"D" not in buf
    assert bytes(buf[4:4 + 16]) == a[:16] and bytes(buf[4 + 16:4 + 16 + 64]) == a[16:80]   # headers untouched
    with pytest.raises(ValueError, match="no kernel of sm_89"):
        prune_fatbin(bytearray(a), 0, len(a), keep_arch=89)
    with pytest.raises(ValueError, match="no fatbin container at byte 0"):
        prune_fatbin(bytearray(b"x" * 32), 0, 32, keep_arch=90)
    short = bytearray(a)
    struct.pack_into("<Q", short, 8, len(a) - 16 - 8)   # the header claims 8 bytes fewer than its entries hold
    with pytest.raises(ValueError, match="entries end at"):
        prune_fatbin(short, 0, len(short), keep_arch=90)


def test_elf_section():
    exe = os.path.realpath(sys.executable)
    with open(exe, "rb") as f:
        buf = f.read()
    off, size = elf_section(buf, ".text")
    assert 0 < off < len(buf) and 0 < size <= len(buf) - off
    with pytest.raises(ValueError, match="no section .nv_fatbin"):
        elf_section(buf, ".nv_fatbin")
    with pytest.raises(ValueError, match="not a little-endian ELF64"):
        elf_section(b"#!/bin/sh\n" + bytes(64), ".text")


def _install(parts_dir, tmp_path):
    return subprocess.run(["bash", os.path.join(ROOT, "tools", "te_install.sh"), str(parts_dir),
                           str(tmp_path / "site")], capture_output=True, text=True, timeout=60)


def test_te_install_refusals(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    p = _install(parts, tmp_path)
    assert p.returncode == 3 and "no " + str(parts) + "/manifest" in p.stdout
    (parts / "part.aa").write_bytes(b"first half")
    (parts / "manifest").write_text("sha256 " + "0" * 64 + "\npart.aa\npart.ab\n")
    p = _install(parts, tmp_path)
    assert p.returncode == 3 and "waiting for parts: part.ab" in p.stdout, p.stdout
    (parts / "part.ab").write_bytes(b"second half")
    p = _install(parts, tmp_path)
    assert p.returncode == 1 and "do not match the manifest's sha256" in p.stdout, p.stdout
    assert not (tmp_path / "site").exists()


def _te_args(timeout):
    return SimpleNamespace(heads="8", seqlens="8192", head_dim=128, causal="no", links="nvlink", iters=1, warmup=0,
                           te_timeout=timeout)


def test_run_te_side_reads_the_rows(monkeypatch):
    """bench_cp's launch of the TE job: the command it builds runs, its JSON (the last argument) comes back."""
    from tools import bench_cp
    code = ("import json, os, sys; json.dump({'rows': [], 'meta': {'pp': os.environ['PYTHONPATH'], "
            "'rank': os.environ.get('RANK')}}, open(sys.argv[-1], 'w'))")
    monkeypatch.setattr(bench_cp, "te_command", lambda py, n, script, a: [py, "-c", code, *a])
    monkeypatch.setenv("RANK", "0")
    doc, why = bench_cp.run_te_side(_te_args(60), ["te_p2p"], 2, "/tmp/te_site_x")
    assert why == "" and doc["meta"]["rank"] is None and doc["meta"]["pp"].split(os.pathsep)[:2] == [
        "/tmp/te_site_x", ROOT]


def test_run_te_side_stops_a_late_job(monkeypatch, tmp_path):
    """Past --te-timeout the TE job's whole process group is stopped and the reason returned (no rows)."""
    from tools import bench_cp
    pidfile = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    monkeypatch.setattr(bench_cp, "te_command", lambda py, n, script, a: [py, "-c", code])
    doc, why = bench_cp.run_te_side(_te_args(3), ["te_p2p"], 2, None)
    assert doc is None and why == "the TE job ran past its 3 s (--te-timeout / --time-limit)"
    grandchild = int(pidfile.read_text())
    for _ in range(50):   # the grandchild (a worker of the job) went with it
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the TE job's worker {grandchild} still runs")


def test_run_te_side_without_rows(monkeypatch):
    from tools import bench_cp
    monkeypatch.setattr(bench_cp, "te_command", lambda py, n, script, a: [py, "-c", "raise SystemExit(3)"])
    assert bench_cp.run_te_side(_te_args(60), ["te_p2p"], 2, None) == (
        None, "the TE job exited 3 without rows (its log is above)")


def test_report_table(tmp_path):
    """bench_cp's .md table: the FA4 floor, auto / FA4 floor and auto / TE p2p columns from the merged rows."""
    from tools import bench_cp
    row = _row(32768, True, modes={"auto": {"fwd_ms": 9.0, "fwd_bwd_ms": 30.0, "ok": True}},
               fa4={"fwd": 8.0, "fwd_bwd": 25.0})
    for name, e in row["modes"].items():
        bench_cp.add_ratios(e, row["floor"])
        bench_cp.add_ratios(e, row["floor_fa4"], tag="fa4")
    merge_te_rows([row], {"rows": [_row(32768, True, modes={"te_p2p": {"fwd_ms": 10.0, "fwd_bwd_ms": 40.0,
                                                                       "ok": False}})]}, ["te_p2p"])
    args = SimpleNamespace(links="nvlink", head_dim=128, iters=5, out=str(tmp_path))
    bench_cp.write_reports([row], args, {"device": "GPU", "date": "d", "torch": "t"})
    md = (tmp_path / "bench_cp_nvlink_P2.md").read_text().splitlines()
    head = [c.strip() for c in md[next(i for i, x in enumerate(md) if x.startswith("| H |"))].split("|")[1:-1]]
    cells = [c.strip() for c in md[-1].split("|")[1:-1]]
    got = dict(zip(head, cells))
    assert got["FA4 floor ms"] == "8.0 / 25.0" and got["auto / FA4 floor"] == "1.125 / 1.200"
    assert got["auto / TE p2p"] == "0.900 / 0.750" and got["te_p2p"].endswith(" X")   # differs: marked


def test_torch_cudnn_home(tmp_path, monkeypatch):
    """TE is pointed at the cuDNN torch ships (nvidia/cudnn/lib/libcudnn.so*), never at an empty or bare folder."""
    import types

    from tools import te_peer
    home = tmp_path / "nvidia" / "cudnn"
    (home / "lib").mkdir(parents=True)
    spec = types.SimpleNamespace(submodule_search_locations=[str(home)])
    monkeypatch.setattr(te_peer.importlib.util, "find_spec", lambda name: spec if name == "nvidia.cudnn" else None)
    assert te_peer.torch_cudnn_home() is None            # the package without its library: not a cuDNN home
    (home / "lib" / "libcudnn.so.9").write_bytes(b"")
    assert te_peer.torch_cudnn_home() == str(home)
    monkeypatch.setattr(te_peer.importlib.util, "find_spec", lambda name: None)
    assert te_peer.torch_cudnn_home() is None            # torch built against a system cuDNN

    def no_parent(name):
        raise ModuleNotFoundError("No module named 'nvidia'")
    monkeypatch.setattr(te_peer.importlib.util, "find_spec", no_parent)
    assert te_peer.torch_cudnn_home() is None            # no nvidia package at all (find_spec raises for the parent)


MAPS = """7f0000000000-7f0000001000 r-xp 00000000 08:01 1234  /opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9
7f0000001000-7f0000002000 r--p 00001000 08:01 1234  /opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9
7f0000002000-7f0000003000 r-xp 00000000 08:01 1240  /opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn_graph.so.9
7f0000003000-7f0000004000 rw-p 00000000 00:00 0
7f0000004000-7f0000005000 r-xp 00000000 08:01 99  /usr/local/cuda/lib64/libcudnn.so.9.14.0
"""


def test_mapped_cudnn_names_the_main_library_files_in_order():
    """Only libcudnn.so* (not its libcudnn_* parts, not anonymous maps), once each, first mapped first."""
    from tools.te_peer import mapped_cudnn
    assert mapped_cudnn(MAPS) == ["/opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9",
                                  "/usr/local/cuda/lib64/libcudnn.so.9.14.0"]
    assert mapped_cudnn("") == []


def test_share_torch_cudnn_points_te_at_the_mapped_cudnn(tmp_path, monkeypatch):
    """The folder of the cuDNN already in the process becomes CUDNN_HOME (TE searches it first); the user's own
    CUDNN_HOME is kept; with nothing mapped, torch's nvidia-cudnn package; with neither, CUDNN_HOME stays unset and
    the meta says so."""
    from tools import te_peer
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    preloaded = []   # the parts preload is called with the file torch mapped (never the real loader here)
    monkeypatch.setattr(te_peer, "preload_cudnn_parts",
                        lambda lib: preloaded.append(lib) or {"loaded": [lib + ".part"], "failed": {}})
    import os
    torch_lib = "/opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9"

    def only_link(home):   # the folder TE globs holds one entry: a link to the file torch mapped
        return os.listdir(home) == ["libcudnn.so.9"] and os.readlink(os.path.join(home, "libcudnn.so.9")) == torch_lib
    env = {}
    seen = te_peer.share_torch_cudnn(env, maps_path=str(maps))
    assert only_link(env["CUDNN_HOME"]) and seen["CUDNN_HOME"] == env["CUDNN_HOME"]
    assert preloaded == [torch_lib] and seen["parts"] == {"loaded": [torch_lib + ".part"], "failed": {}}
    assert seen["source"] == "mapped by torch" and len(seen["mapped"]) == 2 and seen["replaced"] is None
    env = {"CUDNN_HOME": "/usr/local/cuda"}   # a CUDNN_HOME set elsewhere: replaced by the link's folder, recorded
    seen = te_peer.share_torch_cudnn(env, maps_path=str(maps))
    assert only_link(env["CUDNN_HOME"]) and seen["replaced"] == "/usr/local/cuda"
    maps.write_text(f"7f0-7f1 r-xp 00000000 08:01 1 {torch_lib} (deleted)\n")   # replaced on disk while mapped
    assert te_peer.mapped_cudnn(maps.read_text()) == [torch_lib]
    maps.write_text("")
    env = {"CUDNN_HOME": "/my/cudnn"}   # nothing mapped: a set CUDNN_HOME is kept as it is
    seen = te_peer.share_torch_cudnn(env, maps_path=str(maps))
    assert env["CUDNN_HOME"] == "/my/cudnn" and seen["source"] == "as set" and seen["replaced"] is None
    monkeypatch.setattr(te_peer, "torch_cudnn_home", lambda: "/site/nvidia/cudnn")
    env = {}
    assert te_peer.share_torch_cudnn(env, maps_path=str(maps))["source"] == "torch's nvidia-cudnn package"
    assert env["CUDNN_HOME"] == "/site/nvidia/cudnn"
    monkeypatch.setattr(te_peer, "torch_cudnn_home", lambda: None)
    env = {}
    seen = te_peer.share_torch_cudnn(env, maps_path=str(tmp_path / "absent"))
    assert "CUDNN_HOME" not in env and seen["source"].startswith("none found")
    after = te_peer.cudnn_after_te(maps_path=str(tmp_path / "absent"))
    assert after["mapped"] == [] and "torch_cudnn" in after


def test_preload_cudnn_parts_loads_each_part_once_graph_first(tmp_path):
    """The parts beside torch's libcudnn.so.9 are loaded one file per part (the .so.<major> name, not the full
    version's), the graph part first; a part whose load fails is tried again after the others, and one that never
    loads is reported with its error."""
    from tools.te_peer import cudnn_parts, preload_cudnn_parts
    for name in ("libcudnn.so.9", "libcudnn_graph.so.9", "libcudnn_graph.so.9.19.0", "libcudnn_adv.so.9",
                 "libcudnn_heuristic.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_ops.so.9.19.0"):
        (tmp_path / name).write_bytes(b"")
    lib = str(tmp_path / "libcudnn.so.9")
    names = [p.rsplit("/", 1)[1] for p in cudnn_parts(lib)]
    assert names == ["libcudnn_graph.so.9", "libcudnn_adv.so.9", "libcudnn_engines_precompiled.so.9",
                     "libcudnn_heuristic.so.9"]
    calls = []

    def load(path):   # the adv part needs the heuristic part (fails until it is loaded); engines never loads
        name = path.rsplit("/", 1)[1]
        calls.append(name)
        if name == "libcudnn_adv.so.9" and "libcudnn_heuristic.so.9" not in calls[:-1]:
            raise OSError("needs heuristic")
        if name == "libcudnn_engines_precompiled.so.9":
            raise OSError("undefined symbol")
    got = preload_cudnn_parts(lib, load=load)
    assert [p.rsplit("/", 1)[1] for p in got["loaded"]] == ["libcudnn_graph.so.9", "libcudnn_heuristic.so.9",
                                                            "libcudnn_adv.so.9"]
    assert list(got["failed"]) == [str(tmp_path / "libcudnn_engines_precompiled.so.9")]
    assert "undefined symbol" in got["failed"][str(tmp_path / "libcudnn_engines_precompiled.so.9")]
