"""The source-scan tests' one loop: every ``*.py`` under some folders of the repository, each judged by a scan."""
from __future__ import annotations

import pathlib
from typing import Callable, Iterable, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]


def offenders(dirs: Iterable[str], scan: Callable[[pathlib.Path], list],
              skip: Optional[Callable[[pathlib.Path], bool]] = None, min_files: int = 50) -> dict:
    """{relative path: scan(path)} for every ``*.py`` under ``dirs`` (relative to the repository root, ``skip``ped
    ones left out) whose scan found something; asserts more than ``min_files`` files were read (a scan that reads
    nothing cannot fail)."""
    files = [p for d in dirs for p in (ROOT / d).rglob("*.py") if not (skip and skip(p))]
    assert len(files) > min_files, f"the scan read {len(files)} files under {list(dirs)}"
    return {str(p.relative_to(ROOT)): hits for p in files if (hits := scan(p))}
