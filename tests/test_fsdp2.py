"""--use-torch-fsdp2 in the megatron-core entry (CPU, gloo, fp32): FSDP2 over data x context ranks equals the
unsharded run (losses and every parameter after 3 steps), and its DCP checkpoint resumes at another SP size."""
import pytest

pytest.importorskip("megatron.core")

from tests.harness import run_ranks  # noqa: E402

BASE = ["--model", "tiny", "--cp-comm-type", "ulysses", "--frames", "4", "--latent-size", "6x10", "--quiet"]


def _run(rank, world, cp, steps, extra=()):
    from training import pretrain_video_dit
    res = pretrain_video_dit.main([*BASE, "--context-parallel-size", str(cp), "--train-iters", str(steps), *extra],
                                  return_params=True)
    # numpy, not tensors: a tensor put on the harness's queue travels as a shared-memory handle that the parent
    # can only open while this rank is alive, and a rank that exits first loses its result
    return res["losses"], {n: p.numpy() for n, p in res["params"].items()}


def _close(got, ref, what, tol=1e-6):
    (l1, p1), (l0, p0) = got, ref
    assert len(l1) == len(l0) and all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(l1, l0)), \
        f"{what}: losses {l1} vs {l0}"
    assert p1.keys() == p0.keys()
    for n in p0:
        err = float(abs(p1[n] - p0[n]).max())
        assert err <= tol, f"{what}: parameter {n} differs by {err}"


@pytest.mark.parametrize("cp", [2, 4])  # SP=2 x DP=2 and SP=4, 4 ranks
def test_fsdp2_equals_unsharded(cp):
    ref = run_ranks(_run, 4, cp, 3)
    got = run_ranks(_run, 4, cp, 3, ("--use-torch-fsdp2",))
    for r in range(4):
        _close(got[r], ref[r], f"SP={cp} rank {r}")


def test_fsdp2_recompute_full_equals_unsharded():
    ref = run_ranks(_run, 2, 2, 2)
    got = run_ranks(_run, 2, 2, 2, ("--use-torch-fsdp2", "--recompute-granularity", "full"))
    _close(got[0], ref[0], "recompute full")


def test_fsdp2_save_sp4_resume_sp2(tmp_path):
    ck = str(tmp_path / "ck")
    straight = run_ranks(_run, 4, 4, 5, ("--use-torch-fsdp2",))[0]
    first = run_ranks(_run, 4, 4, 3, ("--use-torch-fsdp2", "--save", ck))[0]
    loaded = run_ranks(_run, 2, 2, 3, ("--use-torch-fsdp2", "--load", ck))[0]  # load only (0 steps left)
    assert loaded[0] == [] and loaded[1].keys() == first[1].keys()
    for n in first[1]:  # the checkpoint itself reshards FSDP4 x SP4 -> FSDP2 x SP2 exactly
        assert (loaded[1][n] == first[1][n]).all(), f"parameter {n} changed through save SP=4 / load SP=2"
    rest = run_ranks(_run, 2, 2, 5, ("--use-torch-fsdp2", "--load", ck))[0]  # SP=2, FSDP over 2 ranks
    assert len(first[0]) == 3 and len(rest[0]) == 2
    assert first[0] == straight[0][:3]
    # another SP size sums attention in another order: equal to float rounding, not bit-exact
    _close((first[0] + rest[0], rest[1]), straight, "save SP=4 FSDP4, resume SP=2 FSDP2", tol=1e-5)


def test_fsdp2_refuses_distributed_optimizer(capsys):
    from training import pretrain_video_dit
    with pytest.raises(SystemExit):
        pretrain_video_dit.parse([*BASE, "--use-torch-fsdp2", "--use-distributed-optimizer"])
    err = capsys.readouterr().err
    assert "--use-torch-fsdp2" in err and "--use-distributed-optimizer" in err, err
