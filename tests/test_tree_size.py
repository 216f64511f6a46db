"""tools/ stays under a fifth of the project's Python (#85): lines of .py files under megatron_sp_ext/, training/,
tools/, patches/ and at the top level (setup.py, the autoload hook); tests/ not counted. A benchmark whose results are
recorded and that no doc tells a user to run leaves tools/ with its command in results/README.md ("Retired tools")."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTED = ("megatron_sp_ext", "training", "tools", "patches")
TOOLS_SHARE = 0.20


def python_lines() -> dict[str, int]:
    """{path relative to the root: lines} of every counted .py file."""
    out = {}
    for name in sorted(os.listdir(ROOT)):
        if name.endswith(".py") and os.path.isfile(os.path.join(ROOT, name)):
            out[name] = _lines(os.path.join(ROOT, name))
    for top in COUNTED:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    out[os.path.relpath(path, ROOT)] = _lines(path)
    return out


def _lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def test_tools_are_under_a_fifth_of_the_python():
    lines = python_lines()
    tools = {p: n for p, n in lines.items() if p.startswith("tools" + os.sep)}
    total, in_tools = sum(lines.values()), sum(tools.values())
    assert total > 10_000 and in_tools > 0 and "setup.py" in lines and any(p.startswith("patches") for p in lines)
    biggest = ", ".join(f"{p} {n}" for p, n in sorted(tools.items(), key=lambda t: -t[1])[:8])
    assert in_tools <= TOOLS_SHARE * total, (
        f"tools/ is {in_tools} of {total} Python lines ({in_tools / total:.1%}, over {TOOLS_SHARE:.0%}): retire a "
        f"one-off tool (its command to results/README.md's Retired tools) or merge duplicates; biggest: {biggest}")
