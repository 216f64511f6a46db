"""tests/gpu/cuda_transport.transport_family (the CUDA suite's transport cases, #70 item 5) dry-run on CPU gloo ranks
(SPX_SUITE_DEVICE=cpu, 1/16 of the lengths): without a stand-in every record is refused with the library's reason
(CPU tensors, a gloo group: the suite judges them failed, so on GPUs they must run over NCCL); with the NCCL path
standing in for the transports and fused=False for the fused matmuls every record is judged and passes, the same
34 cases in the same order."""
import pytest

from tests.harness import run_ranks
from tests.gpu.suite_judge import merge_ranks, verdict


@pytest.mark.parametrize("world", [2, 4])
def test_transport_worker_refuses_on_cpu_and_judges_with_a_stand_in(world, monkeypatch):
    import tests.gpu.cuda_transport as mod
    monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(mod, "SHRINK", 16)
    monkeypatch.delenv("SPX_TRANSPORT_STAND_IN", raising=False)
    refused = merge_ranks(run_ranks(mod.transport_family, world, timeout=300))
    assert len(refused) == 34
    assert all(not r["ok"] and r["why"].startswith(("refused", "rank 0: refused")) for r in refused), refused
    assert all("CUDA tensors" in r["refused"] for r in refused), {r["refused"] for r in refused}
    monkeypatch.setenv("SPX_TRANSPORT_STAND_IN", "nccl")
    judged = merge_ranks(run_ranks(mod.transport_family, world, timeout=300))
    assert [r["case"] for r in judged] == [r["case"] for r in refused]
    assert all(r["ok"] for r in judged), [(r["case"], r["why"]) for r in judged if not r["ok"]]
    assert all(r["errs"] for r in judged)
    bitwise = [r for r in judged if "bitwise" in r["case"]]
    assert len(bitwise) == 10 and all(r["tol"] == 0.0 and max(r["errs"].values()) == 0.0 for r in bitwise)
    assert not any(verdict(r) for r in judged)
