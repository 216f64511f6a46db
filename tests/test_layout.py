"""The repository's rooms (#66): the library (megatron_sp_ext/) and training (training/) never import tools/;
tools/ is code (no raw results, which live in the top-level results/; no GPU correctness checks, which live in
tests/gpu/ beside the CUDA suite); tests/gpu/ holds scripts that pytest does not collect."""
import ast
import pathlib

from tests.source_scan import ROOT, offenders

DATA_SUFFIXES = {".json", ".jsonl", ".md", ".log", ".png", ".csv", ".gz", ".tgz", ".tar", ".meta", ".pt"}


def _tools_imports(path: pathlib.Path) -> list:
    """(line, name) of every import of the tools package in ``path``: import/from statements anywhere in the file
    and importlib.import_module / __import__ calls on a literal name."""
    def is_tools(name) -> bool:
        return isinstance(name, str) and (name == "tools" or name.startswith("tools."))

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if is_tools(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and is_tools(node.module):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ("import_module", "__import__") and is_tools(node.args[0].value):
                found.append((node.lineno, node.args[0].value))
    return found


def test_library_and_training_do_not_import_tools():
    found = offenders(("megatron_sp_ext", "training"), _tools_imports)
    assert not found, f"megatron_sp_ext/ and training/ must not import tools/ (move what they need): {found}"


def test_the_import_scan_finds_tools(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport tools.benchlib\nfrom tools import floor\nfrom tools.floor import x\n"
                   "def f():\n    import importlib\n    return importlib.import_module('tools.gpu_ranks')\n"
                   "from .tools import y\nfrom toolsx import z\n")
    assert _tools_imports(bad) == [(2, "tools.benchlib"), (3, "tools"), (4, "tools.floor"), (7, "tools.gpu_ranks")]


def test_tools_holds_no_results_and_no_checks():
    tools = ROOT / "tools"
    folders = sorted(str(p.relative_to(ROOT)) for p in tools.rglob("*") if p.is_dir() and p.name == "results")
    assert not folders, f"raw results go under the top-level results/, not tools/: {folders}"
    data = sorted(str(p.relative_to(ROOT)) for p in tools.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
    assert not data, f"tools/ is code; raw results go under the top-level results/: {data}"
    checks = sorted(str(p.relative_to(ROOT)) for p in tools.rglob("check_*.py"))
    assert not checks, f"GPU correctness checks go under tests/gpu/, not tools/: {checks}"
    assert (ROOT / "results" / "README.md").is_file()


def test_gpu_holds_the_cuda_suite_and_scripts_pytest_does_not_collect():
    """tests/gpu/: the CUDA suite (test_cuda.py, its only pytest module; skipped on CPU), its families (cuda_*.py) and
    judge, and the GPU checks run as scripts (check_*.py). No CUDA suite module is left at tests/."""
    scripts = sorted(p.name for p in (ROOT / "tests" / "gpu").glob("*.py") if p.name != "__init__.py")
    assert "check_fa4_tiles.py" in scripts and "cuda_suite.py" in scripts and "suite_judge.py" in scripts
    collected = [n for n in scripts if n.startswith("test_") or n.endswith("_test.py")]
    assert collected == ["test_cuda.py"], f"tests/gpu/ holds the CUDA suite and GPU scripts: {collected}"
    left = sorted(p.name for p in (ROOT / "tests").glob("*.py")
                  if p.name.startswith("cuda_") or p.name in ("test_cuda.py", "suite_judge.py"))
    assert not left, f"the CUDA suite's modules go under tests/gpu/: {left}"
