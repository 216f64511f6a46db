"""Every group the library makes carries its parent's collective timeout (or the one given), not
torch's 30-minute default: the DeepSpeed mpu's groups, the USP mesh's groups, and new_subgroup."""
import datetime

from tests.harness import COLLECTIVE_TIMEOUT_S, run_ranks

WORLD_TIMEOUT = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)  # what the harness' default group has


def _timeouts(rank, world):
    import torch.distributed as dist
    import megatron_sp_ext as spx
    from megatron_sp_ext.topology.groups import group_timeout, new_subgroup
    from megatron_sp_ext.deepspeed import build_sequence_parallel_groups
    out = {"world": group_timeout()}
    mpu = build_sequence_parallel_groups(2)
    out.update(sp=group_timeout(mpu.sp_group), seq_data=group_timeout(mpu.seq_data_group),
               data=group_timeout(mpu.data_group))
    given = build_sequence_parallel_groups(2, timeout=datetime.timedelta(seconds=7))
    out["sp_given"] = group_timeout(given.sp_group)
    short = new_subgroup(range(world), timeout=datetime.timedelta(seconds=11))
    out["child_of_short"] = group_timeout(new_subgroup(range(world), short))
    mesh = spx.build_sp_mesh(dist.group.WORLD, num_heads=8, placement="usp", ulysses_size=2)
    out.update(ulysses=group_timeout(mesh.ulysses_group), ring=group_timeout(mesh.ring_group))
    return out


def test_groups_inherit_the_collective_timeout():
    got = run_ranks(_timeouts, 4)
    for rank, t in enumerate(got):
        assert t["world"] == WORLD_TIMEOUT, t
        for name in ("sp", "seq_data", "data", "ulysses", "ring"):
            assert t[name] == WORLD_TIMEOUT, (rank, name, t)
        assert t["sp_given"] == datetime.timedelta(seconds=7), t
        assert t["child_of_short"] == datetime.timedelta(seconds=11), t
