"""Run the stock DeepSpeed script training/ds_examples/train_ulysses.py as an installed package leaves it: in this
fresh interpreter, process SITE_DIR as site-packages (what pip put there: the .pth files of a wheel or an editable
install), import deepspeed (the .pth's hook, if any, runs now), then train one step on 2 forked gloo ranks with
each CONFIG in turn. Prints one JSON line: {"hooked": <deepspeed.initialize's _megatron_sp_ext marker>, "runs": [per
config: [per rank: {"error": message} or {"attention": [class names of the engine's DistributedAttention modules]}]]}.

    python tests/stock_deepspeed.py SITE_DIR CONFIG [CONFIG ...]
"""
import importlib
import json
import os
import runpy
import site
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank(rank, world, config):
    from deepspeed.sequence.layer import DistributedAttention
    mod = runpy.run_path(os.path.join(ROOT, "training", "ds_examples", "train_ulysses.py"))  # its main() not run
    try:
        res = mod["main"](["--deepspeed_config", config, "--steps", "1"])
    except Exception as e:  # noqa: BLE001 - the message is the result
        return {"error": f"{type(e).__name__}: {e}"}
    return {"attention": sorted({type(m).__name__ for m in res["engine"].module.modules()
                                 if isinstance(m, DistributedAttention)})}


def main(site_dir: str, *configs: str) -> None:
    assert "deepspeed" not in sys.modules
    site.addsitedir(site_dir)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # skip the ~25 s CPU op build
    import deepspeed
    import torch._dynamo  # noqa: F401 - torch's optimizers import it on first use: ~13 s per forked rank otherwise
    hooked = getattr(deepspeed.initialize, "_megatron_sp_ext", False)
    from tests.harness import run_ranks
    runs = [run_ranks(_rank, 2, config, timeout=120) for config in configs]
    print(json.dumps({"hooked": hooked, "runs": runs}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
