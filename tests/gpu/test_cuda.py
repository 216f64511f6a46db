"""The CUDA suite (`make test-gpu`): every algorithm's CUDA branches against float64 at P=2 and P=4.

P ranks share GPU 0 over gloo (CUDA tensors; exchanges through host memory), and where the machine has at least
P GPUs the same cases run again with one rank per GPU over NCCL. Cases: tests/gpu/cuda_suite.py. Each case's relative
errors (output and every input gradient) must be finite and within a finite tolerance (bf16 2e-2, fp16 5e-3, fp32
1e-5, float64 1e-10), and no worker may have refused the case (tests/gpu/suite_judge.py); with SPX_CUDA_REPORT=<dir> every case's errors are written to <dir>/cuda_<family>_P<P>_<backend>.json.
Without CUDA every test here is skipped (reason: needs CUDA); the CPU suite covers the same control flow
(tests/fake_cudnn.py runs the cuDNN branch on the CPU).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.harness import run_ranks
from tests.reference import curve_err
from tests.gpu.suite_judge import merge_ranks, worst_item

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run `make test-gpu` on a GPU)")


def _layouts():
    out = []
    for world in (2, 4):
        out.append((world, "gloo"))
        if torch.cuda.is_available() and torch.cuda.device_count() >= world:
            out.append((world, "nccl"))
    return out


def _run_family(family: str, world: int, backend: str, timeout: float = 900) -> list:
    from tests.gpu import cuda_suite
    per_rank = run_ranks(cuda_suite.FAMILIES[family], world, timeout=timeout, device="cuda", backend=backend)
    return _check(family, world, backend, per_rank)


def _check(family: str, world: int, backend: str, per_rank: list) -> list:
    """Every rank's records merged and judged (tests/gpu/suite_judge.py: a refused record, a non-finite error or a
    non-finite tolerance fails), written to SPX_CUDA_REPORT, printed; fails the test on any bad record."""
    merged = merge_ranks(per_rank)
    report = os.environ.get("SPX_CUDA_REPORT")
    if report:
        os.makedirs(report, exist_ok=True)
        with open(os.path.join(report, f"cuda_{family}_P{world}_{backend}.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": merged}, f,
                      indent=1)
    for m in merged:
        name, err = worst_item(m["errs"])
        print(f"{'ok ' if m['ok'] else 'BAD'} {m['family']:<14} {m['case']:<90} max {name} {err:.2e}"
              + ("" if m["ok"] else f"  ({m['why']})"))
    bad = [m for m in merged if not m["ok"]]
    assert not bad, "\n".join(f"{m['family']} {m['case']}: {m['why']} (errs {m['errs']}, tol {m['tol']})"
                              for m in bad)
    return merged


@pytest.mark.parametrize("world,backend", _layouts())
def test_call_order_regression(world, backend):
    """Contiguous then zigzag (then auto) causal Ulysses with one chunk, same shapes: right gradients."""
    assert len(_run_family("order", world, backend)) == 14


@pytest.mark.parametrize("world,backend", _layouts())
def test_ulysses_family(world, backend):
    assert len(_run_family("ulysses", world, backend)) >= 100


@pytest.mark.parametrize("world,backend", _layouts())
def test_packed_family(world, backend):
    assert len(_run_family("packed", world, backend)) >= 6


@pytest.mark.parametrize("world,backend", _layouts())
def test_ring_family(world, backend):
    assert len(_run_family("ring", world, backend)) >= 20


@pytest.mark.parametrize("world,backend", [wb for wb in _layouts() if wb[0] == 4])
def test_mesh_family(world, backend):
    assert len(_run_family("mesh", world, backend)) >= 20


@pytest.mark.parametrize("world,backend", _layouts())
def test_block_family(world, backend):
    assert len(_run_family("block", world, backend)) >= 8


@pytest.mark.parametrize("world,backend", _layouts())
def test_dropout_family(world, backend):
    assert len(_run_family("dropout", world, backend)) == 4


def _adapter(name: str, world: int, backend: str) -> list:
    from tests.gpu import cuda_adapters
    return _check(name, world, backend, run_ranks(getattr(cuda_adapters, f"{name}_family"), world, timeout=900,
                                                  device="cuda", backend=backend))


@pytest.mark.parametrize("world,backend", _layouts())
def test_megatron_block_cp_vs_cp1(world, backend):
    """megatron-core TransformerBlock with our core attention at CP=P == the same weights at CP=1."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    assert len(_adapter("megatron", world, backend)) == 16


@pytest.mark.parametrize("world,backend", _layouts())
def test_deepspeed_adapter_vs_distributed_attention(world, backend):
    """SPDistributedAttention == DeepSpeed's own DistributedAttention, same local attention callable."""
    pytest.importorskip("deepspeed", reason="needs deepspeed (carried as a wheel to the GPU machine)")
    assert len(_adapter("deepspeed", world, backend)) >= 12


@pytest.mark.parametrize("world,backend", _layouts())
def test_dit_entry_sp_vs_sp1(world, backend):
    """The DiT entry point (training/pretrain_video_dit.py) at SP=P against SP=1: 5 steps' losses within 1e-4."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    from tests.gpu.cuda_adapters import dit_losses
    ref = run_ranks(dit_losses, 1, ("ulysses",), timeout=600, device="cuda", backend=backend)[0]["ulysses"]
    got = run_ranks(dit_losses, world, timeout=900, device="cuda", backend=backend)
    per_rank = [[{"family": "dit-entry", "case": f"SP={world} {mode} vs SP=1, 5 steps, tiny, fp32",
                  "errs": {"loss": curve_err(losses, ref)}, "tol": 1e-4}
                 for mode, losses in r.items()] for r in got]
    from tests.gpu.cuda_adapters import DIT_MODES
    cases = len([m for m in DIT_MODES if not (m == "usp" and world < 4)]) + (backend == "nccl")   # + megatron DDP
    assert len(_check("dit", world, backend, per_rank)) == cases


@pytest.mark.parametrize("world,backend", _layouts())
def test_tp_cp_block(world, backend):
    """The TP x CP attention block (TP2 x CP1 on 2 ranks, TP2 x CP2 on 4) against its float64 reference."""
    from tests.gpu import cuda_tp_cp
    got = run_ranks(cuda_tp_cp.tp_cp_block_family, world, timeout=600, device="cuda", backend=backend)
    assert len(_check("tp_cp", world, backend, got)) == 18


@pytest.mark.parametrize("world,backend", _layouts())
def test_dit_fused_regions_match_eager(world, backend):
    """The DiT entry's torch.compile'd elementwise regions (--fused-elementwise on) against eager, bf16, 8 steps:
    every loss within 2e-2 relative (bf16 noise; Inductor's reductions round differently)."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    from tests.gpu.cuda_adapters import dit_fused_losses
    got = run_ranks(dit_fused_losses, world, timeout=900, device="cuda", backend=backend)
    per_rank = [[{"family": "dit-fused", "case": f"SP={world} ulysses bf16 8 steps, fused regions vs eager",
                  "errs": {"loss": curve_err(r["on"], r["off"])}, "tol": 2e-2}]
                for r in got]
    assert len(_check("dit_fused", world, backend, per_rank)) == 1


def test_dit_fused_regions_fp32_match_eager():
    """--fused-elementwise in fp32 at the shapes whose compiled backward failed (wan-1.3b dims, B=1, 8190 tokens):
    the model's gradients and the DiT entry's 3 losses against eager (tests/gpu/cuda_fused_fp32.py), on one GPU."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    assert len(_worker("cuda_fused_fp32", "fused_fp32_family", "fused_fp32", 1, "gloo")) == 2


@pytest.mark.parametrize("world,backend", _layouts())
def test_varlen_family(world, backend):
    """Packed variable-length samples (cu_seqlens) through Ulysses / HCMS on CUDA."""
    assert len(_run_family("varlen", world, backend)) == 32



def _worker(module: str, fn: str, family: str, world: int, backend: str, timeout: float = 900) -> list:
    import importlib
    got = run_ranks(getattr(importlib.import_module(f"tests.gpu.{module}"), fn), world, timeout=timeout, device="cuda",
                    backend=backend)
    return _check(family, world, backend, got)


@pytest.mark.parametrize("world,backend", _layouts())
def test_tp_cp_vs_megatron_layer(world, backend):
    """The TP x CP block's forms and auto against Megatron's own TP sequence-parallel self-attention (same weights)."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    assert len(_worker("cuda_tp_cp", "tp_cp_megatron_family", "tp_cp_megatron", world, backend)) == 8


@pytest.mark.parametrize("world,backend", _layouts())
def test_ring_varlen_family(world, backend):
    """Packed variable-length samples through ring, TASP, the usp/tas meshes and torus."""
    assert len(_worker("cuda_ring_varlen", "ring_varlen_family", "ring_varlen", world, backend)) == \
        {2: 20, 4: 28}[world]


@pytest.mark.parametrize("world,backend", _layouts())
def test_ring_rotation_family(world, backend):
    """The ring backward that sends each step's dK|dV partial home (head-chunked last step) against float64 and
    against the traveling-accumulator schedule."""
    assert len(_worker("cuda_ring_rotation", "ring_rotation_family", "ring_rotation", world, backend)) == 14


@pytest.mark.parametrize("world,backend", _layouts())
def test_dit_packed_family(world, backend):
    """The DiT on packed mixed-size samples at SP=P: loss and gradients equal one-sample-at-a-time."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    assert len(_worker("cuda_dit_packed", "dit_packed_family", "dit_packed", world, backend)) == 6


@pytest.mark.parametrize("world,backend", _layouts())
def test_dit_sparse_family(world, backend):
    """The DiT's block-sparse step (top-k, window, a grid the tile cuts; 128-token tiles, head dim 64) at SP=P in
    ulysses / hcms / ring (/ usp): SP=1's loss and gradients, fp32 and bf16 on "auto" (FA4's block sparsity)."""
    assert len(_worker("cuda_dit_sparse", "dit_sparse_family", "dit_sparse", world, backend)) == {2: 18, 4: 24}[world]


@pytest.mark.parametrize("world,backend", _layouts())
def test_diffusers_family(world, backend):
    """The diffusers client (megatron_sp_ext.diffusers.parallelize) on diffusers' WanTransformer3DModel at SP=P in
    every mode, fp32 and bf16, with and without a test-only sparse plan, I2V / TI2V / VACE / checkpointing: the
    output, the latent's and the parameters' gradients (summed over SP) against the stock SP=1 model in float64."""
    pytest.importorskip("diffusers", reason="needs diffusers 0.42 (carried as a wheel to the GPU machine)")
    assert len(_worker("cuda_diffusers", "diffusers_family", "diffusers", world, backend)) == {2: 17, 4: 23}[world]


@pytest.mark.parametrize("world,backend", [(1, "gloo")] + _layouts())
def test_diffusers_fused_family(world, backend):
    """fuse_elementwise (every Wan block compiled by Inductor, the attention opaque) on diffusers' Wan, stock at P=1
    and through parallelize at P, fp32 and bf16, with the sparse plan, diffusers' checkpointing and the attention
    kept: output and gradients against the stock SP=1 model in float64; a case that compiled no graph fails."""
    pytest.importorskip("diffusers", reason="needs diffusers 0.42 (carried as a wheel to the GPU machine)")
    assert len(_worker("cuda_diffusers_fused", "diffusers_fused_family", "diffusers_fused", world, backend)) == \
        (10 if world == 1 else 8)


@pytest.mark.parametrize("world,backend", _layouts())
def test_diffusers_sparse_family(world, backend):
    """BlockSparsePlan (window, VSA top-k with the gated coarse branch; 128-token tiles) on diffusers' Wan through
    parallelize at SP=P in ulysses / hcms / ring (/ usp), fp32 and bf16: output and gradients against a float64
    single-device reference; the top-k masks equal on every rank."""
    pytest.importorskip("diffusers", reason="needs diffusers 0.42 (carried as a wheel to the GPU machine)")
    assert len(_worker("cuda_diffusers_sparse", "diffusers_sparse_family", "diffusers_sparse", world, backend)) == \
        {2: 12, 4: 16}[world]


@pytest.mark.parametrize("world,backend", _layouts())
def test_dit_dynamic_family(world, backend):
    """The DiT under dynamic SP (each packed sample on its own sub-group): loss and gradients equal SP=1 on the same
    pack, fp32 and bf16 autocast."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    assert len(_worker("cuda_dit_dynamic", "dit_dynamic_family", "dit_dynamic", world, backend)) == \
        (6 if world == 2 else 8)


def test_varlen_local_kernels():
    """The local kernels for packed samples (per sample, grouped by length, torch's flash varlen, cuDNN ragged where
    its probe passes, and auto) against float64 per sample, on one GPU."""
    got = _worker("cuda_varlen_local", "varlen_local_family", "varlen_local", 1, "gloo")
    # 16 cases per method (per_sample, grouped, flash_varlen where its probe passes, fa4_varlen where FA4 is
    # installed) and auto; with FA4 required its varlen kernel must be among them (80 cases on 2026-11-29, H200)
    methods = {c["case"].split()[0].split("=")[0] for c in got}   # "auto=<its pick>" counts as auto
    if os.environ.get("SPX_REQUIRE_FA4") == "1":
        assert "fa4_varlen" in methods, sorted(methods)
    assert {"per_sample", "grouped"} <= methods and len(got) == 16 * len(methods), (len(got), sorted(methods))


@pytest.mark.parametrize("world,backend", _layouts())
def test_auto_family(world, backend):
    """auto's branches (Ulysses/HCMS, ring, TASP) forced through the real calibration, and the CUDA-event
    calibration itself, against float64."""
    assert len(_worker("cuda_auto_copies", "auto_family", "auto", world, backend)) == {2: 14, 4: 18}[world]


@pytest.mark.parametrize("world,backend", _layouts())
def test_exchange_copies_family(world, backend):
    """The adapters' Ulysses exchanges with the placement riding on them and fused-view packs: bitwise equal to the
    plain path, and against float64."""
    assert len(_worker("cuda_auto_copies", "exchange_copies_family", "exchange_copies", world, backend)) == 10


@pytest.mark.parametrize("world,backend", _layouts())
def test_fa4_family(world, backend):
    """Every mode with backend="fa4" named (FlashAttention-4), FA4 and cuDNN calls interleaved, against float64."""
    if os.environ.get("SPX_REQUIRE_FA4") != "1":
        pytest.importorskip("flash_attn.cute", reason="needs flash-attn-4 (tools/gpu_run.sh installs it when carried)")
    assert len(_worker("cuda_fa4", "fa4_family", "fa4", world, backend)) == {2: 50, 4: 56}[world]


@pytest.mark.parametrize("world,backend", _layouts())
def test_block_sparse_family(world, backend):
    """Block-sparse attention (#45): Ulysses / HCMS on flex_attention, the ring's skip schedule on the math block
    kernel, against a float64 masked reference."""
    assert len(_worker("cuda_block_sparse", "block_sparse_family", "block_sparse", world, backend)) == \
        {2: 28, 4: 34}[world]


@pytest.mark.parametrize("world,backend", _layouts())
def test_fa4_block_sparse_family(world, backend):
    """#53: every mode (the factory's auto too) on FlashAttention-4's own block sparsity (backend "fa4" named), 64- and 128-token tiles,
    random per-head (an empty query-tile row) / window / all-True masks, causal and not, against float64."""
    if os.environ.get("SPX_REQUIRE_FA4") != "1":
        pytest.importorskip("flash_attn.cute", reason="needs flash-attn-4 (tools/gpu_run.sh installs it when carried)")
    assert len(_worker("cuda_block_sparse", "fa4_block_sparse_family", "fa4_block_sparse", world, backend)) == \
        {2: 40, 4: 70}[world]


@pytest.mark.parametrize("world,backend", _layouts())
def test_cudnn_block_sparse_family(world, backend):
    """#69: every mode on cuDNN frontend's block-sparse attention (backend "cudnn_block_sparse" named), 64- and
    128-token tiles, random per-head (an empty query-tile row) / window / all-True masks, causal and not, against
    float64. Skipped with its reason where the package or the GPU is not one it runs on (SPX_REQUIRE_CUDNN_BSA=1,
    set by tools/gpu_install.sh where the carried package imports: it must run); the package is found without importing it (its import loads cuDNN)."""
    from megatron_sp_ext.attention.kernels import cudnn_block_sparse as cbs
    reason = cbs.why_not(torch.device("cuda", 0), torch.bfloat16, 128)
    if reason is not None:
        if os.environ.get("SPX_REQUIRE_CUDNN_BSA") == "1":
            pytest.fail(f"SPX_REQUIRE_CUDNN_BSA=1 but cuDNN's block-sparse attention does not run here: {reason}")
        pytest.skip(f"cuDNN's block-sparse attention does not run here: {reason}")
    assert len(_worker("cuda_block_sparse", "cudnn_block_sparse_family", "cudnn_block_sparse", world, backend)) == \
        {2: 48, 4: 84}[world]


@pytest.mark.parametrize("world,backend", [(1, "gloo")] + _layouts())
def test_tile_sync_family(world, backend):
    """#85: a top-k mask new per layer costs no host sync (torch.cuda.set_sync_debug_mode("error")): the kernel choice
    and metadata of every head chunk (any P), the Ulysses/HCMS chunks' kernel calls (P > 1; gloo's exchanges sync by
    themselves and stay outside the scope), the factory's one-rank call forward and backward (P = 1), on "auto" and on
    each of FA4 / cuDNN block-sparse / math that runs here (tests/gpu/cuda_tile_sync.py)."""
    # tiles x causal x (metadata + warm-up and chunks for C=1,2; or warm-up and the layer at P=1)
    per_setting = 2 * 2 * (1 + (4 if world > 1 else 2))
    got = _worker("cuda_tile_sync", "tile_sync_family", "tile_sync", world, backend)
    assert len(got) >= 2 * per_setting and len(got) % per_setting == 0   # "auto" and math at least


@pytest.mark.parametrize("world,backend", _layouts())
def test_one_ring_family(world, backend):
    """The block-masked ring and TASP through the one ring (#50): the same device mask changed in place between
    calls, a dense call between masked ones, a host mask with device q; float64 reference."""
    assert len(_worker("cuda_one_ring", "one_ring_family", "one_ring", world, backend)) == 10


@pytest.mark.parametrize("world,backend", [(1, "gloo")] + [wb for wb in _layouts() if wb[1] == "nccl"])
def test_fsdp2_model_vs_unsharded(world, backend):
    """#52: the DiT under FSDP2 (bf16 compute weights, fp32 reduction) against the unsharded DiT under the same bf16
    autocast, token ids on the host as the entry passes them: loss and every gradient within bf16 tolerance. On one
    GPU as a world of one, and one rank per GPU over NCCL where there are enough GPUs. Not P ranks on one GPU over
    gloo: FSDP2's all-gather / reduce-scatter of CUDA tensors over gloo kills the rank (SIGSEGV; 1 x H100, torch
    2.11, 2026-11-25), while gloo on CPU tensors runs it (tests/test_fsdp2.py); P > 1 needs P GPUs."""
    assert len(_worker("cuda_fsdp2", "fsdp2_model_family", "fsdp2", world, backend)) == 4


def test_fsdp2_entry_vs_unsharded_entry():
    """#52: training/pretrain_video_dit.py --bf16 with --use-torch-fsdp2 against the same run without it (megatron's
    DDP), one GPU, 6 steps: every loss within bf16 tolerance (2e-2 relative)."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    from tests.gpu.cuda_fsdp2 import fsdp2_entry_losses
    r = run_ranks(fsdp2_entry_losses, 1, timeout=600, device="cuda", backend="nccl")[0]  # megatron DDP: no gloo on CUDA
    per_rank = [[{"family": "fsdp2-entry", "case": "entry --bf16 --use-torch-fsdp2 vs megatron DDP, 6 steps, tiny",
                  "errs": {"loss": curve_err(r["fsdp2"], r["plain"])}, "tol": 2e-2}]]
    assert len(r["fsdp2"]) == len(r["plain"]) == 6
    assert len(_check("fsdp2_entry", 1, "nccl", per_rank)) == 1


def test_dit_entry_high_priority_streams():
    """training/pretrain_video_dit.py --high-priority-stream-groups cp dp_cp (megatron-core's NCCL stream priority,
    #84's SM-starvation check) runs on one GPU over NCCL, its losses those of the run without it (bf16 tolerance)."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    from tests.gpu.cuda_fsdp2 import priority_entry_losses
    r = run_ranks(priority_entry_losses, 1, timeout=600, device="cuda", backend="nccl")[0]
    per_rank = [[{"family": "entry-priority", "case": "entry --bf16 --high-priority-stream-groups cp dp_cp vs "
                  "without, 4 steps, tiny", "errs": {"loss": curve_err(r["priority"], r["plain"])}, "tol": 2e-2}]]
    assert len(r["priority"]) == len(r["plain"]) == 4
    assert len(_check("entry_priority", 1, "nccl", per_rank)) == 1


def test_wan_trainer_fused_elementwise(tmp_path):
    """training/train_wan_diffusers.py --fused-elementwise on (Inductor over every Wan block, our attention opaque)
    against off on one GPU over NCCL: tiny preset, LoRA, the attention kept, fp32 (1e-5) and --bf16 (2e-2): the
    losses and the trained adapters; the fused runs compiled at least one graph, the eager ones none."""
    pytest.importorskip("diffusers", reason="needs diffusers 0.42 (carried as a wheel to the GPU machine)")
    pytest.importorskip("peft", reason="needs peft (carried as a wheel to the GPU machine)")
    from tests.gpu.cuda_wan_trainer import fused_trainer_runs
    from tests.test_wan_diffusers_train import write_prepared
    data = str(tmp_path / "data")
    write_prepared(data, "tiny")
    r = run_ranks(fused_trainer_runs, 1, data, timeout=900, device="cuda", backend="nccl")[0]
    rows = []
    for form, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
        on, off = r[form]["on"], r[form]["off"]
        assert on["graphs"] >= 1 and off["graphs"] == 0, (form, on["graphs"], off["graphs"])
        assert len(on["losses"]) == len(off["losses"]) == 3 and on["params"].keys() == off["params"].keys()
        errs = {"loss": curve_err(on["losses"], off["losses"])}
        for n, p in off["params"].items():
            errs[n] = float(abs(on["params"][n] - p).max()) / max(1.0, float(abs(p).max()))
        rows.append({"family": "wan-trainer-fused", "case": f"train_wan_diffusers tiny LoRA selective {form}: "
                     f"--fused-elementwise on ({on['graphs']} graphs) vs off, 3 steps", "errs": errs, "tol": tol})
    assert len(_check("wan_trainer_fused", 1, "nccl", [rows])) == 2


def test_dit_entry_data_path_and_manual_gc(tmp_path):
    """The entry as torchrun starts it on one GPU (DataLoader workers allowed): the default worker count
    (loop.default_workers over this host), --manual-gc --manual-gc-interval 2 and --timing against the plain
    in-thread data path without them: 6 fp32 losses within 1e-5 (the same math; only where batches are built and
    when the collector runs change), every metrics row with its data_wait_ms and gc_ms, timing.json naming the
    workers and the collector mode."""
    pytest.importorskip("megatron.core", reason="needs megatron-core (carried as a wheel to the GPU machine)")
    import subprocess
    import sys
    from training.video_dit.loop import default_workers
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = ["--model", "tiny", "--frames", "4", "--latent-size", "8x12", "--train-iters", "6", "--seed", "3",
            "--fused-elementwise", "off", "--quiet"]
    runs = {}
    for name, extra in (("plain", ["--num-workers", "0"]),
                        ("new", ["--manual-gc", "--manual-gc-interval", "2", "--timing", "--timing-bare-steps", "2"])):
        log_dir = tmp_path / name
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                            "--master-port", "29631", "-m", "training.pretrain_video_dit", *base, *extra,
                            "--log-dir", str(log_dir)], cwd=root, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
        runs[name] = rows
    err = curve_err([r["loss"] for r in runs["new"]], [r["loss"] for r in runs["plain"]])
    per_rank = [[{"family": "dit-data", "case": "entry default workers + --manual-gc 2 + --timing vs in-thread data, "
                  "6 steps, tiny, fp32", "errs": {"loss": err}, "tol": 1e-5}]]
    assert len(runs["new"]) == len(runs["plain"]) == 6
    assert all(r.get("data_wait_ms") is not None and r.get("gc_ms") is not None for r in runs["new"])
    timing = json.load(open(tmp_path / "new" / "timing.json"))
    assert timing["num_workers"] == default_workers(len(os.sched_getaffinity(0)), 1) and timing["manual_gc"]
    assert timing["manual_gc_interval"] == 2
    assert len(_check("dit_data", 1, "nccl", per_rank)) == 1


def test_device_batches_equal_prepare_on_cuda():
    """pipeline.step_inputs on CUDA (2 DataLoader workers, pinned, each batch copied one step ahead on a copy
    stream): every step's inputs equal engine.prepare's on the GPU bit for bit, read on a compute stream that runs
    behind the host while each used batch is freed and the next one copied (a batch's memory handed to the next
    copy before the compute stream's reads ran shows as a mismatch)."""
    from training.video_dit import preset
    from training.video_dit.data import SyntheticVideoLatents
    from training.video_dit.engine import flow_matching_batch, prepare
    from training.video_dit.pipeline import StepBatches, step_inputs
    cfg = preset("tiny")
    data = SyntheticVideoLatents(cfg.in_channels, [4, 3], 32, 48, cfg.text_len, cfg.text_dim, seed=3)
    sb = StepBatches(data, start=0, stop=8, seed=9, dp_rank=1, dp_world=2, micro_batch=1, patch=cfg.patch,
                     sp_rank=1, sp_world=2, tile=(2, 2, 2))
    busy = torch.randn(4096, 4096, device="cuda") / 64
    got = []
    it = step_inputs(sb, "cuda", num_workers=2)
    for step, inp, _ in it:
        for _ in range(10):   # ~20 ms of queued work: this batch's reads below still pending when the next
            busy = (busy @ busy).tanh_()   # prefetch allocates (reusing the block early would overwrite them)
        it.prefetch()
        got.append((step, {k: getattr(inp, k).clone() for k in ("x", "target", "valid", "t", "text")}))
        del inp
    assert [s for s, _ in got] == list(range(8))
    for step, inp in got:
        ref = prepare(flow_matching_batch(data, step, 9, 1, 2, 1, cfg.patch, tile=(2, 2, 2)), 1, 2, "cuda")
        for k, v in inp.items():
            assert torch.equal(v, getattr(ref, k)), (step, k)


@pytest.mark.parametrize("world,backend", [(1, "gloo")] + [wb for wb in _layouts() if wb[1] == "nccl"])
def test_recompute_family(world, backend):
    """#67: full recompute, selective outside_core_attn (the attention core kept: q, k, v, out, lse) and the same
    with --cpu-offloading against no recompute, bf16 autocast, on the GPU's kernels (explicit backward from out +
    lse), SP = world (plain and packed q|k|v): loss and gradients within bf16 tolerance, and the core run once per
    layer under outside_core_attn, twice under full. One GPU as a world of one; one rank per GPU over NCCL."""
    assert len(_worker("cuda_recompute", "recompute_family", "recompute", world, backend)) == \
        (8 if world == 1 else 16)


def test_wan_rope_fused_bitwise():
    """megatron_sp_ext.diffusers.rope's fused Wan RoPE (one triton kernel per direction) against diffusers' eager
    ops (rope.wan_rotary_eager) on this GPU: output and input gradient bit for bit, bf16 / fp16 / fp32 inputs with
    float32 tables (random and Wan's own from WanRotaryPosEmbed), odd lengths, B=2, head dims 128 / 64 / 2, a
    non-contiguous input (a chunk of a fused QKV projection)."""
    from megatron_sp_ext.diffusers import rope
    cases = [((1, 37, 12, 128), "random"), ((2, 1001, 5, 64), "random"), ((1, 3, 1, 2), "random"),
             ((1, 2 * 6 * 10, 12, 128), "wan")]
    checked = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for (b, s, h, d), tables in cases:
            g = torch.Generator(device="cuda").manual_seed(s * d + h)
            if tables == "wan":
                from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
                pos = WanRotaryPosEmbed(d, (1, 2, 2), 1024).cuda()
                cos, sin = pos(torch.zeros(1, 16, 2, 12, 20, device="cuda"))   # 2 x 6 x 10 patches
                assert cos.shape == (1, s, 1, d) and cos.dtype == torch.float32
            else:
                cos, sin = (torch.randn(1, s, 1, d, device="cuda", generator=g) for _ in range(2))
            qkv = torch.randn(b, s, 3 * h * d, device="cuda", generator=g).to(dtype)
            for x in (qkv[..., : h * d].unflatten(2, (h, d)), torch.randn(b, s, h, d, device="cuda",
                                                                          generator=g).to(dtype)):
                assert rope.fused_applies(x, cos, sin) is None, rope.fused_applies(x, cos, sin)
                grad = torch.randn(b, s, h, d, device="cuda", generator=g).to(dtype)
                x_ref = x.detach().clone().requires_grad_()
                x_fused = x.detach().clone().requires_grad_()
                out_ref = rope.wan_rotary_eager(x_ref, cos, sin)
                out_fused = rope.wan_rotary(x_fused, cos, sin)
                out_ref.backward(grad)
                out_fused.backward(grad)
                where = f"{dtype} {(b, s, h, d)} {tables} contiguous={x.is_contiguous()}"
                assert out_fused.dtype == out_ref.dtype and torch.equal(out_fused, out_ref), \
                    f"{where}: forward differs by {(out_fused.float() - out_ref.float()).abs().max().item()}"
                assert torch.equal(x_fused.grad, x_ref.grad), \
                    f"{where}: backward differs by {(x_fused.grad.float() - x_ref.grad.float()).abs().max().item()}"
                checked += 1
    assert checked == 24


def test_layout_word_copies_bitwise():
    """The Ulysses layouts' word copies on this GPU (layout.copy_bits: 8-byte words) against the same functions on
    CPU tensors (value copies): pack, unpack, to_kernel_layout and to_send_layout with and without the zigzag order,
    P 2 / 4, MHA / GQA / uneven heads, 1-2 chunks, bshd / sbhd, B 1-2, D 8 / 6 (6 bf16 values are not whole words:
    value copies there), bf16 / fp32, a head dim sliced out of a wider tensor; every output bit for bit, and the
    word path taken where it can be."""
    import itertools

    from megatron_sp_ext.sp.heads import head_layout
    from megatron_sp_ext.sp.ulysses import layout as lay
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    g = torch.Generator().manual_seed(0)
    cases = words = 0
    for world, (h, hk), chunks, seq_layout, b, d, dtype, pad in itertools.product(
            (2, 4), ((8, 8), (8, 2), (6, 2), (5, 5)), (1, 2), ("bshd", "sbhd"), (1, 2), (8, 6),
            (torch.bfloat16, torch.float32), (0, 4)):
        try:
            hl = head_layout(h, hk, world, chunks)
        except Exception:  # noqa: BLE001 - a layout the head counts do not allow
            continue
        s, kinds, hr = 4, ("q", "kv", "kv"), hk * hl.kv_repeat
        dims = (s, b) if seq_layout == "sbhd" else (b, s)
        raw = torch.randint(-30000, 30000, (*dims, h + 2 * hr, d + pad), dtype=ints[dtype], generator=g).view(dtype)
        for c in range(hl.chunks):
            total = sum(lay.seg_splits(hl, kinds, c, s * b, d))
            ws = lay.widths(hl, kinds, 0, c)
            zig = lay.seq_order([[(p * s // 2, s // 2), ((2 * world - 1 - p) * s // 2, s // 2)]
                                 for p in range(world)])
            recv = torch.randint(-30000, 30000, (world * s, b, sum(ws), d + pad), dtype=ints[dtype],
                                 generator=g).view(dtype)
            res = []
            for dev in ("cpu", "cuda"):
                parts = list(torch.split(raw.to(dev)[..., :d], [h, hr, hr], dim=2))
                out = torch.zeros(total, dtype=dtype, device=dev)
                lay.pack(parts, kinds, hl, c, seq_layout, out)
                back = [torch.zeros_like(t) for t in parts]
                lay.unpack(out, back, kinds, hl, c, seq_layout)
                buf = recv.to(dev)[..., :d]   # a received [S, B, W, D] buffer (sliced out of a wider one)
                kern = [lay.to_kernel_layout(t, o) for o in (zig, None) for t in lay.columns_sbhd(buf, ws)]
                sent = torch.zeros_like(buf)
                for view, k in zip(lay.columns_sbhd(sent, ws), kern[:3]):
                    lay.to_send_layout(k, zig, view)
                res.append([out, *back, *kern, sent])
                if dev == "cuda":
                    words += lay.as_words(parts[0]) is not None
            for i, (a, x) in enumerate(zip(*res)):
                assert torch.equal(a.contiguous().view(ints[dtype]), x.cpu().contiguous().view(ints[dtype])), \
                    (world, h, hk, chunks, seq_layout, b, d, dtype, pad, c, i)
            cases += 1
    assert cases > 100 and words > 0, (cases, words)


@pytest.mark.parametrize("world,backend", [wb for wb in _layouts() if wb[1] == "nccl"])
def test_transport_family(world, backend):
    """#70 item 5: the copy-engine transports (symm_mem, copy_engine) in Ulysses / HCMS against float64 and bit for
    bit against NCCL (dq within NCCL's own run-to-run noise), the async block through them, and the all-gather
    block on torch's fused symm_mem matmuls against float64 (tests/gpu/cuda_transport.py). One rank per GPU over NCCL
    only: these paths need an NCCL group (over gloo every record would be refused)."""
    got = _worker("cuda_transport", "transport_family", "transport", world, backend)
    assert len(got) == 34  # per transport 4 shapes x 3 records + the async block; 8 fused all-gather cases


@pytest.mark.parametrize("hkv", (8, 2))
def test_fa4_deterministic_backward(hkv):
    """--deterministic-mode on FA4 (attention/kernels/fa4.py): under torch's deterministic switch FA4's backward
    gives the same bits on every rerun (dq, and with GQA dk/dv, without atomics), and is right against float64;
    without the switch it need not be. 4,096 tokens, 8 heads (GQA 8/2), bf16, causal and not."""
    if os.environ.get("SPX_REQUIRE_FA4") != "1":
        pytest.importorskip("flash_attn.cute", reason="needs flash-attn-4 (tools/gpu_run.sh installs it when carried)")
    from megatron_sp_ext.attention.kernels import fa4
    from tests.reference import TOL, reference_attention
    reason = fa4.why_not(torch.device("cuda"), torch.bfloat16, 128)
    assert reason is None, reason
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 4096, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(1, hkv, 4096, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    do = torch.randn(1, 8, 4096, 128, device="cuda", generator=g).bfloat16()
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        for causal in (False, True):
            out, lse = fa4.forward(q, k, v, 128 ** -0.5, causal)
            runs = [fa4.backward(do, q, k, v, out, lse, 128 ** -0.5, causal) for _ in range(3)]
            for again in runs[1:]:
                assert all(torch.equal(a, b) for a, b in zip(runs[0], again)), f"causal={causal}: a rerun differs"
            qr, kr, vr = (t.double().transpose(1, 2).requires_grad_() for t in (q, k, v))
            ref = reference_attention(qr, kr, vr, causal=causal)   # [B, S, H, D]
            ref.backward(do.double().transpose(1, 2))
            for name, got, want in zip(("dq", "dk", "dv"), runs[0], (qr.grad, kr.grad, vr.grad)):
                err = float((got.double().transpose(1, 2) - want).norm() / want.norm())
                assert err < TOL[torch.bfloat16], f"causal={causal} {name}: rel err {err:.2e}"
    finally:
        torch.use_deterministic_algorithms(was)
