"""#66: the cross-rank block-mask check once per distinct mask (sp.checks.MaskChecks).

Counted with a wrapper around torch.distributed.all_gather (the check's one collective): 10 calls with one mask do
1 check (the old per-call check: 10); a mask mutated in place between calls is checked again (and refused by name
when the mutation made the ranks differ); a mask declared agreed ("already agreed" token) costs no collective until
it changes; a freed mask's entry goes, and a new mask at its address is checked. The calls' outputs and gradients
are the float64 masked reference's (tests/test_block_sparse.check_case). gloo, CPU, P=2."""
import torch
import torch.distributed as dist

import megatron_sp_ext as spx
from megatron_sp_ext.config import SPConfig
from megatron_sp_ext.errors import SPConfigError
from megatron_sp_ext.sp.checks import MaskChecks
from megatron_sp_ext.sp.factory import SPResources, make_attention
from tests.harness import run_ranks
from tests.test_block_sparse import check_case, random_mask

S, H, D, BS = 32, 4, 8, 8
T = S // BS


class GatherCount:
    """Counts torch.distributed.all_gather calls while active (the mask check's collective)."""

    def __init__(self) -> None:
        self.calls, self._orig = 0, None

    def __enter__(self) -> "GatherCount":
        self._orig = dist.all_gather

        def counted(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)
        dist.all_gather = counted
        return self

    def __exit__(self, *exc) -> None:
        dist.all_gather = self._orig


def _counts(rank, world):
    g = dist.group.WORLD
    mask = random_mask(3, H, T)
    out = {}
    for name, checks in (("per_mask", MaskChecks()), ("per_call", MaskChecks(per_call=True))):
        call = lambda q, k, v, c=checks: spx.ulysses_attention(q, k, v, g, block_mask=mask, block_size=BS,
                                                               mask_checks=c)
        check_case(call, rank, world, s=S, h=H, hkv=H, d=D, bs=BS, block_mask=mask, causal=False)  # warm, checked
        with GatherCount() as n:
            for _ in range(10):
                check_case(call, rank, world, s=S, h=H, hkv=H, d=D, bs=BS, block_mask=mask, causal=False)
        out[name] = (n.calls, checks.collectives)
    # the factory's attention keeps its checks in its SPResources: ring, 10 calls of one mask
    res = SPResources()
    attn = make_attention(SPConfig(mode="ring"), g, num_heads=H, resources=res)
    with GatherCount() as n:
        for _ in range(10):
            check_case(lambda q, k, v: attn(q, k, v, causal=True, block_mask=mask, block_size=BS), rank, world,
                       s=S, h=H, hkv=H, d=D, bs=BS, block_mask=mask, causal=True)
    out["factory_ring"] = (res.mask_checks.collectives, n.calls >= 1)
    return out


def test_ten_calls_with_one_mask_do_one_collective():
    for res in run_ranks(_counts, 2, timeout=120):
        assert res["per_mask"] == (0, 1), res      # the warm-up call checked it: no collective in the 10
        assert res["per_call"] == (10, 11), res    # the old behaviour: every call
        assert res["factory_ring"] == (1, True), res


def _in_place(rank, world):
    g = dist.group.WORLD
    checks = MaskChecks()
    q = torch.randn(1, S // world, H, D, dtype=torch.float64)
    mask = random_mask(5, 1, T, keep=0.6)
    log = []
    call = lambda: spx.ring_attention(q, q, q, g, block_mask=mask, block_size=BS, mask_checks=checks)  # noqa: E731
    call()
    call()
    log.append(checks.collectives)                 # 1: the second call was a hit
    mask[0, 0, 0] ^= True                          # the same in-place change on every rank: checked again, runs
    call()
    log.append(checks.collectives)                 # 2
    mask[0, 2, 1] ^= rank > 0                      # in place on every rank, but now the ranks' masks differ
    try:
        call()
        log.append("ran")
    except SPConfigError as e:
        log.append("refused" if "block_mask differs between ranks" in str(e) else str(e))
    other = mask.clone()                           # a new mask object with rank 0's ... differing contents: refused
    try:
        spx.ulysses_attention(q, q, q, g, block_mask=other, block_size=BS, mask_checks=checks)
        log.append("ran")
    except SPConfigError as e:
        log.append("refused" if "block_mask differs between ranks" in str(e) else str(e))
    return log


def test_a_mask_changed_in_place_is_checked_again_and_refused_when_ranks_differ():
    for log in run_ranks(_in_place, 2, timeout=120):
        assert log == [1, 2, "refused", "refused"], log


def _agreed_and_freed(rank, world):
    g = dist.group.WORLD
    checks = MaskChecks()
    q = torch.randn(1, S // world, H, D, dtype=torch.float64)
    spx.ulysses_attention(q, q, q, g)              # the shape check's own all_gather, once per shape: done here
    mask = checks.agree(random_mask(7, H, T), g)   # built the same on every rank: the token, no collective
    with GatherCount() as n:
        for _ in range(3):
            spx.ulysses_attention(q, q, q, g, block_mask=mask, block_size=BS, mask_checks=checks)
    log = [n.calls, checks.collectives]
    mask.logical_not_()                           # changed in place after the declaration: compared again
    spx.ulysses_attention(q, q, q, g, block_mask=mask, block_size=BS, mask_checks=checks)
    log.append(checks.collectives)
    spare = checks.agree(random_mask(8, H, T), g)
    entries = len(checks)
    del spare                                     # freed: its entry goes with it
    log.append(entries - len(checks))
    for _ in range(3):                            # new masks (the allocator may reuse the freed address): each checked
        spx.ulysses_attention(q, q, q, g, block_mask=random_mask(7, H, T), block_size=BS, mask_checks=checks)
    log.append(checks.collectives)
    return log


def test_an_agreed_mask_costs_no_collective_until_it_changes_and_freed_masks_are_forgotten():
    for log in run_ranks(_agreed_and_freed, 2, timeout=120):
        assert log == [0, 0, 1, 1, 4], log
