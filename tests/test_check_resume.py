"""tests/gpu/check_resume.py on the CPU dry run of the full-depth resume jobs (resume40a/b, results/README.md): the
megatron-core entry with FSDP2 at SP=2 (gloo, fp32) saves at step 2 of 4, resumes from it, and the resumed steps'
losses equal the uninterrupted run's bit for bit; a changed loss or a missing step fails, naming the step."""
import json

import pytest

pytest.importorskip("megatron.core")

from tests.harness import run_ranks  # noqa: E402
from tests.gpu import check_resume  # noqa: E402

BASE = ["--model", "tiny", "--cp-comm-type", "ulysses", "--frames", "4", "--latent-size", "6x10", "--quiet",
        "--context-parallel-size", "2", "--use-torch-fsdp2", "--recompute-granularity", "selective",
        "--recompute-modules", "outside_core_attn", "--log-interval", "1", "--num-workers", "0"]


def _run(rank, world, extra):
    from training import pretrain_video_dit
    return pretrain_video_dit.main([*BASE, *extra])["losses"]


def test_resume_is_bit_identical_and_a_change_is_named(tmp_path, capsys):
    ck, d = str(tmp_path / "ck"), {k: str(tmp_path / k) for k in ("straight", "first", "resumed")}
    run_ranks(_run, 2, ["--train-iters", "4", "--log-dir", d["straight"]])
    run_ranks(_run, 2, ["--train-iters", "2", "--save", ck, "--log-dir", d["first"]])
    run_ranks(_run, 2, ["--train-iters", "4", "--load", ck, "--log-dir", d["resumed"]])
    out = tmp_path / "resume.json"
    assert check_resume.main(["--straight", d["straight"], "--resumed", d["resumed"], "--first", d["first"],
                              "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["bit_identical"] and res["resumed"]["steps"] == 2 and res["first"]["steps"] == 2
    assert [r["step"] for r in res["resumed"]["rows"]] == [2, 3]  # 0-based steps
    assert res["resumed"]["max_rel_diff"] == 0.0
    path = tmp_path / "resumed" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows[-1]["loss"] = rows[-1]["loss"] * (1 + 1e-7)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert check_resume.main(["--straight", d["straight"], "--resumed", d["resumed"]]) == 1
    assert "resumed step 3" in capsys.readouterr().err


def test_rtol_passes_a_resume_at_another_sp_size_within_it(tmp_path, capsys):
    """--rtol (#70: a resume from SP=2 to SP=1, whose reductions round differently): steps within it pass,
    bit_identical stays False; a step over it fails, naming it; no rtol: bit for bit."""
    def write(name, losses):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses.items()))
        return str(d)
    straight = write("straight", {s: 1.0 + s for s in range(6)})
    near = write("near", {4: 5.0 * (1 + 3e-6), 5: 6.0})
    far = write("far", {4: 5.0 * (1 + 3e-4), 5: 6.0})
    out = tmp_path / "r.json"
    assert check_resume.main(["--straight", straight, "--resumed", near, "--rtol", "1e-5", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["passed"] and not res["bit_identical"] and res["resumed"]["identical"] == 1
    assert check_resume.main(["--straight", straight, "--resumed", near]) == 1
    assert check_resume.main(["--straight", straight, "--resumed", far, "--rtol", "1e-5"]) == 1
    assert "resumed step 4" in capsys.readouterr().err
