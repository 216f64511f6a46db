"""The ```python blocks of the guides in docs/ that show the public API run as written under a real
``torchrun --nproc-per-node 2`` (gloo, CPU), as the README's do (tests/test_readme.py)."""
import os
import subprocess
import sys

import pytest

import megatron_sp_ext as spx
from tests.test_readme import ROOT, _free_port, python_blocks

DOCS = ("docs/block_sparse.md",)
BLOCKS = [(doc, i, block) for doc in DOCS for i, block in enumerate(python_blocks(os.path.join(ROOT, doc)))]


def test_docs_have_python_blocks():
    assert {doc for doc, _, _ in BLOCKS} == set(DOCS), "a guide lost its ```python example"


def test_factory_is_public():
    """``spx.make_attention`` and ``spx.SPConfig``: the names the guides call (issue #51 item 2)."""
    assert {"make_attention", "SPConfig"} <= set(spx.__all__)
    from megatron_sp_ext.sp.factory import make_attention
    assert spx.make_attention is make_attention


@pytest.mark.parametrize("doc,i,block", BLOCKS, ids=[f"{d}:{i}" for d, i, _ in BLOCKS])
def test_doc_block_runs_as_written(doc, i, block, tmp_path):
    script = tmp_path / f"doc_block_{i}.py"
    script.write_text(block)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        _free_port(), str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"{doc} block {i} failed:\n{block}\n{(r.stdout + r.stderr)[-3000:]}"
