"""``python -m megatron_sp_ext.megatron.launch`` reports its own errors first (issue #51 item 5): a missing script
or a bad value of one of our flags is ONE stderr line under the launcher's name, printed before anything imports
megatron.core (whose "Transformer Engine and Apex are not installed" warnings used to come first), with no usage
dump under the program name MEGATRON_SP_EXT_ARGS, exit status 2. Our flags are checked with the Megatron-LM flags
they depend on (--context-parallel-size, --cp-comm-type, heads, --attention-dropout) as at model build."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "megatron_sp_ext.megatron.launch"
# runs the launcher as -m does, then says whether megatron.core was imported on the way to the error
PROBE = ("import runpy, sys\n"
         "try:\n"
         f"    runpy.run_module({PROG!r}, run_name='__main__', alter_sys=True)\n"
         "finally:\n"
         "    print('megatron.core imported' if 'megatron.core' in sys.modules else 'megatron.core not imported')\n")


def _launch(tmp_path, *argv: str, probe: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-c", PROBE, *argv] if probe else [sys.executable, "-m", PROG, *argv]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "pretrain_gpt.py"
    path.write_text("raise SystemExit('the script must not run')\n")
    return str(path)


CASES = {  # case: (arguments after the script, what the one line names)
    "bad value": (["--context-parallel-size", "2", "--hcms-head-chunks", "zero"], "--hcms-head-chunks"),
    "unknown choice": (["--sp-ring-variant", "spiral"], "--sp-ring-variant"),
    # combinations with Megatron-LM's own flags (issue #70 item 5), checked before the script runs
    "bad cp type": (["--context-parallel-size", "2", "--cp-comm-type", "bogus"], "--cp-comm-type='bogus' is invalid"),
    "ulysses size": (["--context-parallel-size", "4", "--cp-comm-type", "usp", "--sp-ulysses-size", "3",
                      "--attention-dropout", "0"], "--sp-ulysses-size=3 must divide --context-parallel-size 4"),
    # Megatron-LM's default --attention-dropout 0.1, which the ring cannot apply (model build refused it)
    "ring dropout": (["--context-parallel-size", "2", "--cp-comm-type", "ring", "--hcms-head-chunks", "2"],
                     "--attention-dropout=0.1 is not supported by --cp-comm-type='ring'"),
    "chunks per heads": (["--num-attention-heads", "8", "--context-parallel-size", "4", "--cp-comm-type", "hcms",
                          "--hcms-head-chunks", "4"], "--hcms-head-chunks=4 exceeds the heads per rank"),
}


@pytest.mark.parametrize("case", ["missing script", *CASES])
def test_one_line_under_the_launchers_name_before_megatron(case, tmp_path, script):
    argv, needle = ((["nosuch/pretrain_gpt.py"], "no such script: nosuch/pretrain_gpt.py") if case == "missing script"
                    else ([script, "--num-layers", "2", *CASES[case][0]], CASES[case][1]))
    r = _launch(tmp_path, *argv)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith(f"{PROG}: ") and needle in lines[0], lines[0]
    assert "MEGATRON_SP_EXT_ARGS" not in r.stderr and "usage" not in r.stderr, r.stderr
    assert "Transformer Engine" not in r.stderr + r.stdout
    probed = _launch(tmp_path, *argv, probe=True)
    assert "megatron.core not imported" in probed.stdout, probed.stdout + probed.stderr


def test_usage_line_names_the_launcher(tmp_path):
    r = _launch(tmp_path)
    assert r.returncode == 2 and r.stderr.strip().startswith(f"usage: python -m {PROG} "), r.stderr

