"""Under a real torchrun, a user's error is the root cause of torchrun's report: the bottom "Root Cause" section
carries our one-line message (through TORCHELASTIC_ERROR_FILE), not "To enable traceback see ..."."""
import json
import os
import socket
import subprocess
import sys

from megatron_sp_ext.elastic_error import ERROR_FILE_ENV, record_user_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_record_user_error_writes_torch_elastic_format(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.delenv(ERROR_FILE_ENV, raising=False)
    assert not record_user_error("x")
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    assert record_user_error("--cp-comm-type='bogus' is invalid")
    data = json.loads(path.read_text())["message"]
    assert data["message"] == "--cp-comm-type='bogus' is invalid"
    assert data["extraInfo"]["py_callstack"] == data["message"] and "Traceback" not in path.read_text()


def test_torchrun_root_cause_is_our_message():
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", _free_port(),
           "training/pretrain_video_dit.py", "--model", "tiny", "--context-parallel-size", "3",
           "--train-iters", "1"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    report = r.stdout + r.stderr
    root = report.split("Root Cause (first observed failure):", 1)
    assert len(root) == 2, report[-3000:]
    assert "--context-parallel-size" in root[1] and "To enable traceback" not in root[1], root[1]
