"""The ```python blocks of the guides in docs/ that show the public API run as written under a real
``torchrun --nproc-per-node 2`` and ``4`` (gloo, CPU), as the README's do (tests/test_readme.py): a guide's example
must not hold only at the one size it was tried at (docs/block_sparse.md's failed at 4 ranks: 2 HCMS chunks of 4
heads)."""
import os
import subprocess
import sys

import pytest

import megatron_sp_ext as spx
from tests.test_readme import BLOCKS as README_BLOCKS
from tests.test_readme import ROOT, _free_port, python_blocks

DOCS = ("docs/block_sparse.md", "docs/choosing_a_mode.md")
BLOCKS = [(doc, i, block) for doc in DOCS for i, block in enumerate(python_blocks(os.path.join(ROOT, doc)))]


def test_docs_have_python_blocks():
    assert {doc for doc, _, _ in BLOCKS} == set(DOCS), "a guide lost its ```python example"


def test_factory_is_public():
    """``spx.make_attention`` and ``spx.SPConfig``: the names the guides call (issue #51 item 2)."""
    assert {"make_attention", "SPConfig"} <= set(spx.__all__)
    from megatron_sp_ext.sp.factory import make_attention
    assert spx.make_attention is make_attention


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("doc,i,block", BLOCKS, ids=[f"{d}:{i}" for d, i, _ in BLOCKS])
def test_doc_block_runs_as_written(doc, i, block, nproc, tmp_path):
    script = tmp_path / f"doc_block_{i}.py"
    script.write_text(block)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                        "--master-port", _free_port(), str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{doc} block {i} at {nproc} ranks failed:\n{block}\n{(r.stdout + r.stderr)[-3000:]}"


# Run after a block with the collector off: a gloo group still alive after ``destroy_process_group`` (held in a
# reference cycle, freed only by the collector or at interpreter exit) keeps its worker threads, and tearing it
# down during interpreter exit aborted the process ("terminate called without an active exception": 9 of 20 exits
# of a 2-rank script holding its group in a cycle, 0 of 20 without the cycle).
_NO_GLOO_THREAD_LEFT = """
import os as _os
_left = [n for n in (open(f"/proc/self/task/{t}/comm").read().strip() for t in _os.listdir("/proc/self/task"))
         if "gloo" in n]
assert not _left, f"gloo threads alive after destroy_process_group: {_left}"
print("NO_GLOO_THREAD_LEFT")
"""


# Reference cycles that held a group past its destroy (issue #83 item 2): sp/checks.py MaskChecks._remember (its
# entry's weakref callback closed over the entry's dict, which held the group; MaskChecks left with #85's redesign)
# and sp/ring/torus.py _Ctx (its ``_mk`` lambda closed over ``self``, which holds the mesh and its groups).


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists the process's threads through /proc (Linux)")
@pytest.mark.parametrize("doc,i,block", [pytest.param(*b) for b in BLOCKS]
                         + [("README.md", i, b) for i, b in enumerate(README_BLOCKS)],
                         ids=[f"{d}:{i}" for d, i, _ in BLOCKS] + [f"README.md:{i}" for i in range(len(README_BLOCKS))])
def test_doc_block_leaves_no_gloo_group_alive(doc, i, block, tmp_path):
    """After a guide's block destroys its groups, no gloo thread is left without the garbage collector's help:
    nothing of the library keeps a group alive past ``destroy_process_group`` (tests/test_doc_examples.py's
    ``block_sparse.md`` block aborted at exit in CI while the block-mask check cache held the world group in a
    reference cycle)."""
    script = tmp_path / f"doc_block_{i}.py"
    script.write_text("import gc\ngc.disable()\n" + block + _NO_GLOO_THREAD_LEFT)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", _free_port(), str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and out.count("NO_GLOO_THREAD_LEFT") == 2, f"{doc} block {i}:\n{out[-3000:]}"


def test_training_speed_states_the_num_workers_default():
    """docs/training_speed.md's --num-workers default is the code's (it once said 4): half of the rank's share of
    the CPUs, 2 to 8, on CUDA; 0 on CPU."""
    import argparse

    import torch

    from training.video_dit.loop import default_workers, resolve_workers
    with open(os.path.join(ROOT, "docs", "training_speed.md")) as f:
        text = " ".join(f.read().split())
    assert ("(default on CUDA: half of this rank's share of the host's CPUs, at least 2 and at most 8, "
            "`loop.default_workers`; 0 on CPU)") in text
    assert [default_workers(c, r) for c, r in ((12, 2), (4, 4), (128, 1), (64, 8))] == [3, 2, 8, 4]
    assert resolve_workers(argparse.Namespace(num_workers=None), torch.device("cpu")) == 0


def _doc_text(name: str) -> str:
    with open(os.path.join(ROOT, "docs", name)) as f:
        return " ".join(f.read().split())


def test_choosing_a_mode_says_auto_times_block_masks():
    """auto times its candidates with a block-sparse call's mask (sp/factory.py SPAttention.mode_for, since 7dcd9a7);
    only packed samples, dropout and a caller's local attention run the baseline untimed (the guide once listed
    block masks there too)."""
    text = _doc_text("choosing_a_mode.md")
    assert "a call with a block mask times them with that mask, once per mask shape and tile size" in text
    assert ("Calls with packed samples, attention dropout or your own local attention run its baseline (HCMS) "
            "without timing") in text
    assert "Calls with a block mask" not in text


def test_diffusers_guide_says_what_tas_and_torus_need():
    """tas is refused on one machine without nodes=, torus runs there (tests/test_diffusers_wan.py checks both);
    the guide once said both need several machines."""
    text = _doc_text("diffusers.md")
    assert "tas needs more than one machine (`nodes=` simulates them; on one machine without it, it is refused" in text
    assert "torus is meant for slow links between machines but also runs on one" in text
    assert "tas/torus need more than one machine" not in text
