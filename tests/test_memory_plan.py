"""tools/memory_plan.py: within 10% of the measured bench_train_step peaks, and its parts add up."""
import pytest

from tools import memory_plan as mp


def test_plan_within_tolerance_of_measured_peaks():
    rows = mp.validate()
    assert len(rows) == len(mp.MEASURED) == 5
    for r in rows:
        assert abs(r["error"]) <= 0.10, r


@pytest.mark.parametrize("sharding", mp.SHARDINGS)
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_parts_add_up(sharding, recompute):
    p = mp.plan("wan-14b", 75600, 8, 8, sharding, recompute)
    parts = (p.parameters_gib + p.gradients_gib + p.optimizer_gib + p.autocast_copies_gib + p.unsharded_blocks_gib
             + p.activations_gib + p.exchange_gib + p.workspace_gib)
    assert p.total_gib == pytest.approx(parts, rel=1e-12)
    assert p.fits == (p.total_gib <= p.gpu_gib)


def test_sharding_and_recompute_only_lower_memory():
    full = mp.plan("wan-14b", 75600, 8, 8, "none", "none")
    fsdp = mp.plan("wan-14b", 75600, 8, 8, "fsdp", "full")
    assert fsdp.parameters_gib == pytest.approx(full.parameters_gib / 8)
    assert fsdp.activations_gib < full.activations_gib and fsdp.total_gib < full.total_gib


def test_bad_input_names_the_flag():
    with pytest.raises(ValueError, match="--sharding"):
        mp.plan("wan-14b", 1000, 1, 1, "zero2")
    with pytest.raises(ValueError, match="--gpus"):
        mp.plan("wan-14b", 1000, 3, 8)
