"""tools/profile_sparse_sync.py in its dry mode (tiny DiT, top-k block-sparse, CPU, SP=2 over gloo): one JSON with
the step times, the syncs per step and per layer and their sites. CPU has no sync check, so the test stands one in:
a warning like torch's from the top-k selection (once per block forward) and from the gated coarse branch's backward
(once per block backward); the counts must place them in the step and in each layer's forward and backward."""
import contextlib
import json
import warnings

import torch
import torch.distributed as dist

from megatron_sp_ext import video_tiles
from tests.harness import run_ranks
from tools import profile_sparse_sync as tool
from training.video_dit import model as model_mod


@contextlib.contextmanager
def stand_in_sync_mode():
    """Like torch.cuda.set_sync_debug_mode("warn"), with two synthetic syncs per block: top-k and coarse backward."""
    topk, bwd = model_mod.topk_tile_mask, video_tiles._GatedSpread.backward

    def warned(*a, **kw):
        warnings.warn("called a synchronizing CUDA operation")
        return topk(*a, **kw)

    def warned_bwd(ctx, grad):
        warnings.warn("called a synchronizing CUDA operation")
        return bwd(ctx, grad)
    model_mod.topk_tile_mask, video_tiles._GatedSpread.backward = warned, staticmethod(warned_bwd)
    try:
        yield
    finally:
        model_mod.topk_tile_mask, video_tiles._GatedSpread.backward = topk, staticmethod(bwd)


def _dry(rank, world, out, stand_in):
    args = tool.parse(["--dry", "--out", out])
    doc = tool.profile(args, dist.group.WORLD, torch.device("cpu"), stand_in_sync_mode if stand_in else None)
    if rank == 0:
        tool.write_json(args.out, doc)
    return doc


def test_dry_run_counts_syncs_per_step_and_per_layer(tmp_path):
    out = str(tmp_path / "sparse_sync.json")
    docs = run_ranks(_dry, 2, out, True, timeout=180)
    with open(out) as f:
        doc = json.load(f)
    assert doc == json.loads(json.dumps(docs[0]))
    cfg = doc["config"]
    assert cfg["sp"] == 2 and cfg["layers"] == 2 and cfg["dry"] and cfg["topk"] == 3 and cfg["sync_check"]
    assert len(doc["step_ms"]) == 2 and all(t > 0 for t in doc["step_ms"])
    assert doc["syncs_per_step"] == 4                       # 2 blocks x (1 in the forward + 1 in the backward)
    assert doc["per_layer"] == {"block0": {"fwd": 1, "bwd": 1}, "block1": {"fwd": 1, "bwd": 1}}
    assert doc["syncs_per_layer"] == 2
    assert all(site.startswith("tests/test_profile_sparse_sync.py:") for site in doc["sites"]["block0.fwd"])
    assert docs[1]["per_layer"] == doc["per_layer"]         # every rank counts its own: they agree


def test_without_a_sync_check_nothing_is_counted(tmp_path):
    doc = run_ranks(_dry, 1, str(tmp_path / "s.json"), False, timeout=120)[0]
    assert not doc["config"]["sync_check"] and doc["syncs_per_step"] == 0 and doc["sites"] == {}
    assert doc["per_layer"] == {"block0": {"fwd": 0, "bwd": 0}, "block1": {"fwd": 0, "bwd": 0}}
