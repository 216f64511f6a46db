"""tools/gpu_round.sh (the GPU session's runner) and its stage table tools/gpu_stages.txt, on the CPU: every stage
documented and listed; every job's command names files that exist and only flags its tool's --help accepts (the
training entry's flags after a lone "--" against the entry's --help); bad arguments refused by name before anything
runs; and one run end to end on a made-up table with a stand-in nvidia-smi: summaries, tarballs, exit statuses, a
job that needs more GPUs than its stage sees and a job past the call's deadline not started, each with its reason."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tools", "gpu_round.sh")
TABLE = os.path.join(ROOT, "tools", "gpu_stages.txt")
ENTRY = "training/pretrain_video_dit.py"   # the flags after "--" of the step tools go to it


def _run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", RUNNER, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _jobs() -> list[tuple[str, int, int, str]]:
    r = _run("--dry-run")
    assert r.returncode == 0, r.stderr
    rows = [line.split("\t") for line in r.stdout.splitlines()]
    assert rows and all(len(row) == 4 for row in rows), r.stdout
    return [(name, int(g), int(s), cmd) for name, g, s, cmd in rows]


def _commands(cmd: str) -> list[list[str]]:
    """The job's simple commands (split at ; && || |), their words with each ${NAME:-default} at its default (what
    runs when the caller sets nothing)."""
    lex = shlex.shlex(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", cmd), posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    out = [[]]
    for w in lex:
        if w in (";", "&&", "||", "|"):
            out.append([])
        else:
            out[-1].append(w)
    return [c for c in out if c]


def _script(words: list[str]) -> tuple[str | None, list[str]]:
    """(the repository's script a command runs, the words after it), past VAR=value prefixes and torchrun's, bash's
    or python's own words; None for a command that runs no script of the repository (flock, cat, ...)."""
    i = 0
    while i < len(words) and "=" in words[i] and not words[i].startswith("-"):
        i += 1
    if i == len(words) or words[i] not in ("torchrun", "bash", "python3", "python"):
        return None, []
    while i < len(words) and not words[i].endswith((".py", ".sh")):
        i += 1
    assert i < len(words), f"no script in {words}"
    return words[i], words[i + 1:]


def _flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]


def test_every_stage_is_documented_listed_and_fits_a_device_call():
    jobs = _jobs()
    names = list(dict.fromkeys(n for n, _, _, _ in jobs))
    assert {"suite", "cp", "step", "sparse", "diffusers", "memory", "te"} <= set(names)
    docs = re.findall(r"^## (\w+): \S", open(TABLE).read(), re.M)
    assert sorted(docs) == sorted(names), "every stage has one '## NAME: text' line"
    listed = _run("--list").stdout.splitlines()
    assert [line.split()[0] for line in listed] == names
    for name in names:
        total = sum(s for n, _, s, _ in jobs if n == name)
        assert total <= 600, f"stage {name}: {total} s of jobs does not fit one device call (600 s)"
    assert all(g >= 1 for _, g, _, _ in jobs)


def test_every_command_names_files_that_exist_and_flags_its_tool_accepts():
    jobs = _jobs()
    helps: dict[str, subprocess.Popen] = {}
    plan = []
    for name, _, _, cmd in jobs:
        for words in _commands(cmd):
            for w in words:
                if re.match(r"^(tools|tests|training|configs)/[\w/.-]+\.\w+$", w):
                    assert os.path.exists(os.path.join(ROOT, w)), f"stage {name}: {w} does not exist"
            script, rest = _script(words)
            if script is None or not script.endswith(".py"):
                continue
            assert os.path.exists(os.path.join(ROOT, script)), f"stage {name}: {script} does not exist"
            own, entry = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
            plan.append((name, script, _flags(own)))
            if entry:
                plan.append((name, ENTRY, _flags(entry)))
    env = {**os.environ, "PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu"}
    for script in {s for _, s, _ in plan}:   # every --help at once (each imports torch: seconds)
        helps[script] = subprocess.Popen([sys.executable, script, "--help"], cwd=ROOT, env=env, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    texts = {}
    for script, p in helps.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{script} --help: {err[-2000:]}"
        texts[script] = set(re.findall(r"--[\w-]+", out))
    for name, script, flags in plan:
        unknown = [f for f in flags if f not in texts[script]]
        assert not unknown, f"stage {name}: {script} does not take {unknown}"


@pytest.mark.parametrize("arg,says", [("nope", "no stage 'nope'"), ("suite+nope@1", "no stage 'nope'"),
                                      ("suite@x", "is not STAGE"), ("suite@", "is not STAGE")])
def test_a_bad_argument_is_refused_before_anything_runs(arg, says, tmp_path):
    for mode in (["--dry-run"], []):
        r = _run(*mode, arg, env={"OUT": str(tmp_path / "out"), "SPX_GPU_INSTALL": "0"})
        assert r.returncode == 2 and says in r.stderr, (r.returncode, r.stderr)
        assert not (tmp_path / "out").exists()


def test_a_run_writes_each_arguments_summary_and_tarball(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"   # two GPUs
    smi.write_text('#!/bin/sh\ncase "$1" in -L) printf "GPU 0: X\\nGPU 1: X\\n";; *) echo "X, 0";; esac\n')
    smi.chmod(0o755)
    table = tmp_path / "stages.txt"
    table.write_text("## a: two jobs\n"
                     "a 1 60 echo made > $W/made.txt; echo NGPU=$NGPU LEFT=$LEFT\n"
                     "a 1 60 echo failing; sleep 5; exit 3\n"
                     "## b: needs three GPUs\n"
                     "b 3 60 echo never\n"
                     "## c: past the deadline\n"
                     "c 1 60 echo never\n")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "GPU_STAGES": str(table), "OUT": str(out),
           "GPU_ROUND_WORK": str(work), "SPX_GPU_INSTALL": "0", "DEADLINE_S": "38"}
    r = _run("a+b", "b@1", "c", env=env)   # a's jobs start with >= 30 s left of 38, c after a's 5 s with < 30
    assert r.returncode == 0, r.stderr
    summary = (out / "a_b.txt").read_text()
    assert "[a job 1: exit 0]" in summary and "NGPU=2 LEFT=" in summary
    assert "failing" in summary and "[a job 2: exit 3]" in summary
    assert "[b job 1: not started: needs 3 GPUs, sees 2]" in summary
    assert "[b job 1: not started: needs 3 GPUs, sees 1]" in (out / "b.txt").read_text()   # b@1: GPU 1 alone
    assert "[c job 1: not started" in (out / "c.txt").read_text() and "left of the call" in (out / "c.txt").read_text()
    with tarfile.open(out / "a_b.tgz") as t:
        names = set(t.getnames())
        assert {"a_b.meta", "a_b.log", "a/job1.log", "a/job2.log", "a/made.txt"} <= names, names
        meta = t.extractfile("a_b.meta").read().decode()
    assert "gpu: all" in meta and "stages: a b" in meta
    with tarfile.open(out / "b.tgz") as t:
        assert "gpu: 1" in t.extractfile("b.meta").read().decode()
    assert "=== a_b" in r.stdout and "=== c" in r.stdout
