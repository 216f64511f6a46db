"""The README's ```python blocks run as written, each under a real ``torchrun --nproc-per-node 2`` (gloo, CPU).
Signature lists that are not meant to run are ```text blocks (the README says so)."""
import os
import socket
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def python_blocks(path: str) -> list[str]:
    """The ```python fenced blocks of the markdown file at ``path``, in order."""
    with open(path) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.M | re.S)


BLOCKS = python_blocks(os.path.join(ROOT, "README.md"))


def test_readme_has_python_blocks():
    assert BLOCKS, "README.md has no ```python block"


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs_as_written(i, tmp_path):
    script = tmp_path / f"readme_block_{i}.py"
    script.write_text(BLOCKS[i])
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", _free_port(),
                        str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"README block {i} failed:\n{BLOCKS[i]}\n{(r.stdout + r.stderr)[-3000:]}"
