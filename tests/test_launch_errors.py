"""``python -m megatron_sp_ext.megatron.launch`` reports its own errors first (issue #51 item 5): a missing script
or a bad value of one of our flags is ONE stderr line under the launcher's name, printed before anything imports
megatron.core (whose "Transformer Engine and Apex are not installed" warnings used to come first), with no usage
dump under the program name MEGATRON_SP_EXT_ARGS."""
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


@pytest.mark.parametrize("case", ["missing script", "bad value", "unknown choice"])
def test_one_line_under_the_launchers_name_before_megatron(case, tmp_path, script):
    argv = {"missing script": ["nosuch/pretrain_gpt.py"],
            "bad value": [script, "--context-parallel-size", "2", "--hcms-head-chunks", "zero"],
            "unknown choice": [script, "--sp-ring-variant", "spiral"]}[case]
    needle = {"missing script": "no such script: nosuch/pretrain_gpt.py", "bad value": "--hcms-head-chunks",
              "unknown choice": "--sp-ring-variant"}[case]
    r = _launch(tmp_path, *argv)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"{PROG}: ") and needle in lines[0], lines[0]
    assert "MEGATRON_SP_EXT_ARGS" not in r.stderr and "usage" not in r.stderr, r.stderr
    assert "Transformer Engine" not in r.stderr + r.stdout
    probed = _launch(tmp_path, *argv, probe=True)
    assert "megatron.core not imported" in probed.stdout, probed.stdout + probed.stderr


def test_usage_line_names_the_launcher(tmp_path):
    r = _launch(tmp_path)
    assert r.returncode != 0 and r.stderr.strip().startswith(f"usage: python -m {PROG} "), r.stderr
