"""tools/profile_sparse_sync.py in its dry mode (tiny DiT, top-k block-sparse, CPU, SP=2 over gloo): one JSON with
both variants; the per-call check compares every layer's mask on every step, the per-mask one none (the DiT's top-k
masks are declared agreed), and the step times are measured."""
import json

import torch
import torch.distributed as dist

from tests.harness import run_ranks
from tools import profile_sparse_sync as tool


def _dry(rank, world, out):
    args = tool.parse(["--dry", "--out", out])
    doc = tool.profile(args, dist.group.WORLD, torch.device("cpu"))
    if rank == 0:
        tool.write_json(args.out, doc)
    return doc


def test_dry_run_counts_the_mask_checks_of_both_variants(tmp_path):
    out = str(tmp_path / "sparse_sync.json")
    docs = run_ranks(_dry, 2, out, timeout=120)
    with open(out) as f:
        doc = json.load(f)
    assert doc == json.loads(json.dumps(docs[0]))
    cfg, v = doc["config"], doc["variants"]
    assert cfg["sp"] == 2 and cfg["layers"] == 2 and cfg["dry"] and cfg["topk"] == 3
    assert v["per_call"]["mask_collectives_per_step"] == cfg["layers"]   # one sample: one mask per layer per step
    assert v["per_mask"]["mask_collectives_per_step"] == 0                # top-k masks: agreed by construction
    for res in v.values():
        assert len(res["step_ms"]) == 3 and all(t > 0 for t in res["step_ms"])
        assert res["host_syncs_per_step"] is None                         # counted on CUDA only
    assert doc["speedup"] > 0
