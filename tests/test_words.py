"""One word per idea in the library's code (issue 66 item 4; the table is docs/words.md).

Three ideas had one word between them, or one idea several words; the scans below keep them apart:
- "block": a mask tile is a *tile*, a ring's K|V block a *kv block* (one kernel call a *call*), a self-attention
  layer a *layer*, the DeepSpeed JSON section a *section*. What may still say "block" in an identifier: the public
  keywords ``block_mask`` / ``block_size`` (../shared/DESIGN.md's API: a mask of tiles, tokens per tile), the
  technique's name "block-sparse" (``block_sparse``, ``BlockSparse...``), ``kv_block``, anything in kernel code
  (a kernel's own block: attention/kernels/, the Triton RoPE), and the names of other libraries' APIs
  (``non_blocking``, flex_attention's ``create_block_mask`` / ``BlockMask``, a diffusers model's ``.blocks`` /
  ``.vace_blocks`` attributes and its ``compile_repeated_blocks``).
- "placement": only the sequence placement (which tokens a rank holds). The mesh order (usp / tas) is the
  *arrangement*; the mesh modules (topology/, modes.py) say "placement" only as ``build_sp_mesh``'s public keyword.
- "choose": only the one kernel choice (attention/kernels/choose.py). The other choices are named for what they
  return: ``fastest`` (a timed choice among named candidates), ``fastest_for``, ``form_for``, ``mode_for``,
  ``method_for``, ``arrangement_for``, ``chunks_for``.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

from tests.source_scan import ROOT, offenders

LIBRARY = ("megatron_sp_ext",)
KERNEL_CODE = ("megatron_sp_ext/attention/kernels/", "megatron_sp_ext/diffusers/rope.py")
MESH_CODE = ("megatron_sp_ext/topology/", "megatron_sp_ext/modes.py")
CHOOSER = "megatron_sp_ext/attention/kernels/choose.py"

PUBLIC_BLOCK_WORDS = {"block_mask", "block_size"}        # DESIGN.md's keywords, passed through under the same names
FOREIGN_BLOCK_WORDS = {"non_blocking", "create_block_mask", "BlockMask"}   # torch's names
FOREIGN_BLOCK_ATTRIBUTES = {"blocks", "vace_blocks", "compile_repeated_blocks"}   # a diffusers model's layer lists
# (``model.blocks``) and its regional compilation (``ModelMixin.compile_repeated_blocks``)
ALLOWED_BLOCK_PARTS = re.compile(r"block_?sparse|kv_block", re.IGNORECASE)

# Left to the merge of branch h66-problem (its files were being rewritten while these renames were made): (file,
# identifier) pairs still allowed. Empty once that merge has renamed them.
LEFT_FOR_MERGE: set = set()


def _identifiers(tree: ast.AST):
    """(line, identifier, kind) of every name the code gives or uses: "attr" for ``x.name``, else "name"."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.attr, "attr"
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id, "name"
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg, "name"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name, "name"
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.lineno, node.arg, "name"
        elif isinstance(node, ast.alias):
            yield node.lineno, (node.asname or node.name).split(".")[-1], "name"


def _inside(tree: ast.AST, func: str) -> set:
    """Line numbers inside every function named ``func``."""
    return {line for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == func
            for line in range(node.lineno, node.end_lineno + 1)}


def retired_words(path: pathlib.Path, rel: str) -> list:
    """(line, identifier) of every identifier in ``path`` (read as the repository file ``rel``) that uses a retired
    word for its idea (module docstring)."""
    tree = ast.parse(path.read_text(), str(path))
    kernel_code = rel.startswith(KERNEL_CODE)
    mesh_code = rel.startswith(MESH_CODE)
    mesh_keyword_lines = _inside(tree, "build_sp_mesh")
    found = set()
    for line, word, kind in _identifiers(tree):
        if (rel, word) in LEFT_FOR_MERGE:
            continue
        if "block" in word.lower() and not kernel_code and not (
                word in PUBLIC_BLOCK_WORDS or word in FOREIGN_BLOCK_WORDS or ALLOWED_BLOCK_PARTS.search(word)
                or kind == "attr" and word in FOREIGN_BLOCK_ATTRIBUTES):
            found.add((line, word))
        if mesh_code and "placement" in word.lower() and not (word == "placement" and line in mesh_keyword_lines):
            found.add((line, word))
    if rel != CHOOSER:   # "choose" defined only by the one kernel choice
        found |= {(node.lineno, node.name) for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and (node.name == "choose" or node.name.startswith("choose_"))
                  and (rel, node.name) not in LEFT_FOR_MERGE}
    return sorted(found)


def _scan(path: pathlib.Path) -> list:
    return retired_words(path, path.relative_to(ROOT).as_posix())


def test_the_library_uses_one_word_per_idea():
    found = offenders(LIBRARY, _scan)
    assert not found, f"retired words in identifiers (see docs/words.md for the word of each idea): {found}"


def test_the_scan_finds_each_retired_word(tmp_path):
    """A planted file with one offender per rule (and the allowed forms beside them): the scan names exactly the
    offenders, and where a file sits decides the kernel and mesh rules."""
    src = tmp_path / "m.py"
    src.write_text(
        "def pad_block_mask(block_mask, block_size, num_blocks):\n"     # 1: def and an arg
        "    x.copy_(y, non_blocking=True)\n"                           # 2: torch's keyword: fine
        "    be.block_kernel = model.blocks\n"                          # 3: attribute offender, model.blocks fine
        "    blocks = BlockSparsePlan(); kv_block_rows = 1\n"           # 4: a variable named blocks
        "    placement = 'usp'\n"                                        # 5: mesh code only
        "class P:\n"
        "    def choose(self, key):\n"                                   # 7: a second 'choose'
        "        return self.choose(key)\n"                              # 8: a call is not a definition
        "def build_sp_mesh(group, *, placement='auto'):\n"              # 9: the public keyword: fine
        "    return placement\n")
    assert retired_words(src, "megatron_sp_ext/sp/x.py") == [
        (1, "num_blocks"), (1, "pad_block_mask"), (3, "block_kernel"), (4, "blocks"), (7, "choose")]
    assert retired_words(src, "megatron_sp_ext/topology/x.py") == [
        (1, "num_blocks"), (1, "pad_block_mask"), (3, "block_kernel"), (4, "blocks"), (5, "placement"), (7, "choose")]
    assert retired_words(src, "megatron_sp_ext/attention/kernels/x.py") == [(7, "choose")]
    assert retired_words(src, CHOOSER) == []


def test_the_renamed_fields_and_lists():
    """The mesh order is 'arrangement' where the library declares it and in the public settings (SPConfig.arrangement,
    --sp-arrangement, build_sp_mesh(arrangement=)); the older names are still taken (SPConfig(placement=),
    build_sp_mesh(placement=)). The public functions take the AttentionProblem, whose fields are the problem's
    keywords (placement: the token order; tile, with block_size its older name; block_mask)."""
    import inspect  # noqa: PLC0415

    import megatron_sp_ext as spx  # noqa: PLC0415
    from megatron_sp_ext import config, modes  # noqa: PLC0415
    from megatron_sp_ext.topology.mesh import SPMesh  # noqa: PLC0415
    mode_fields = {f.name for f in dataclasses.fields(modes.Mode)}
    assert "arrangement" in mode_fields and "placement" not in mode_fields
    mesh_fields = {f.name for f in dataclasses.fields(SPMesh)}
    assert "arrangement" in mesh_fields and "placement" not in mesh_fields
    assert config.ARRANGEMENTS == ("auto", "usp", "tas") and not hasattr(config, "PLACEMENTS")
    assert {"arrangement", "placement"} <= {f.name for f in dataclasses.fields(spx.SPConfig)}
    assert spx.SPConfig(placement="usp").arrangement == "usp"   # the older name, the same setting
    mesh_params = inspect.signature(spx.build_sp_mesh).parameters
    assert mesh_params["arrangement"].default == "auto" and mesh_params["placement"].default is None
    from megatron_sp_ext.sp import problem as pb  # noqa: PLC0415
    assert {"block_mask", "tile", "placement"} <= set(pb.PROBLEM_KEYWORDS) and pb.ALIASES == {"block_size": "tile"}
    for fn in (spx.ulysses_attention, spx.ring_attention, spx.hybrid_attention, spx.torus_attention):
        params = inspect.signature(fn).parameters
        assert "problem" in params and params["keywords"].kind is inspect.Parameter.VAR_KEYWORD, fn.__name__


def test_every_leftover_is_still_there():
    """An allowance in LEFT_FOR_MERGE that no longer matches anything is stale: remove it (so the list only shrinks)."""
    for rel, word in sorted(LEFT_FOR_MERGE):
        tree = ast.parse((ROOT / rel).read_text())
        assert any(w == word for _, w, _ in _identifiers(tree)), f"{rel}: {word} is gone: drop it from LEFT_FOR_MERGE"
