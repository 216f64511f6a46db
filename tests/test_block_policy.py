"""BlockPolicy decisions (the timing is replaced by fixed numbers; the real one needs CUDA events)."""
import torch

from megatron_sp_ext.sp.block_policy import PLAIN, BlockChoice, BlockPolicy
from tests.harness import run_ranks


class _Scripted(BlockPolicy):
    """Timings from a script: first call = the calibration rounds, second = the confirmation."""

    def __init__(self, scripts, **kw):
        super().__init__(**kw)
        self.scripts, self.runs = list(scripts), 0

    def _timed_rounds(self, run, cands, rounds, group):
        table = self.scripts.pop(0)
        return {c: table.get(c.label, 10.0) for c in cands}


ASYNC2 = BlockChoice(True, 2, "nccl")


def test_candidates_skip_what_cannot_run_here():
    import torch.distributed as dist
    pol = BlockPolicy()

    def body(rank, world):
        cands = pol.candidates(heads_per_rank=1, group=dist.group.WORLD, device=torch.device("cpu"))
        assert [c.label for c in cands] == ["plain", "async", "allgather"]  # C=2 needs 2 heads; symm_mem: CUDA
        cands = pol.candidates(heads_per_rank=4, group=dist.group.WORLD, device=torch.device("cpu"))
        assert [c.label for c in cands] == ["plain", "plain_hcms2", "async", "async_hcms2", "allgather",
                                            "allgather_hcms2"]
        no_ag = BlockPolicy(allgather=False).candidates(heads_per_rank=4, group=dist.group.WORLD,
                                                        device=torch.device("cpu"))
        assert [c.label for c in no_ag] == ["plain", "plain_hcms2", "async", "async_hcms2"]
        return True
    run_ranks(body, 2)


def test_decisions_margin_and_confirmation():
    # clear win, confirmed
    dec = _Scripted([{"plain": 10.0, "async_hcms2": 9.0}, {"plain": 10.0, "async_hcms2": 9.1}])._calibrate(
        None, [PLAIN, ASYNC2], None)
    assert dec.choice == ASYNC2 and dec.confirm == (10.0, 9.1)
    # within the 2% margin: plain, no confirmation needed
    pol = _Scripted([{"plain": 10.0, "async_hcms2": 9.85}])
    dec = pol._calibrate(None, [PLAIN, ASYNC2], None)
    assert dec.choice == PLAIN and "within 2%" in dec.reason and not pol.scripts
    # looked faster, lost the confirmation: plain
    dec = _Scripted([{"plain": 10.0, "async_hcms2": 9.0}, {"plain": 10.0, "async_hcms2": 9.9}])._calibrate(
        None, [PLAIN, ASYNC2], None)
    assert dec.choice == PLAIN and "lost the interleaved confirmation" in dec.reason
    # a tie at the top goes to plain
    dec = _Scripted([{"plain": 10.0, "async_hcms2": 10.0}])._calibrate(None, [PLAIN, ASYNC2], None)
    assert dec.choice == PLAIN
