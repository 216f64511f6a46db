"""Transformer Engine's context parallelism as a peer of tools/bench_cp.py: the parts that run without TE.

bench_cp.py times our modes, then (``--peers te_p2p,te_a2a,te_all_gather``) rank 0 starts tools/bench_cp_te.py as
its own torchrun on the same GPUs (TE imported only there: once loaded it changes which cuDNN kernel torch's SDPA
picks), reads its rows back and merges them into ONE JSON. This module: the peer names and their checks, where TE
is (``SPX_TE_SITE``, exported by tools/gpu_install.sh), the TE job's command and environment, and the row merge
with the ratios to TE's p2p ring.

    peers = parse_peers("te_p2p,te_a2a")                       # SPConfigError naming --peers on a bad name
    check_grid(peers, heads=[40], seqlens=[32768], world=2)     # SPConfigError on a row TE cannot split
    site = find_te(os.environ)                                  # SPConfigError with the install recipe when absent
    cmd = te_command(sys.executable, 2, "tools/bench_cp_te.py", te_script_args(args, peers, "te_rows.json"))
    env = te_env(os.environ, site, repo_root)
    rows = merge_te_rows(rows, te_doc, peers)                   # + vs_te_p2p_* per mode, auto_vs_te_p2p per row
"""
from __future__ import annotations

import glob
import importlib.util
import os
import tempfile
from typing import Mapping, Optional, Sequence

from megatron_sp_ext.errors import SPConfigError
from tools.floor import add_ratios

TE_VERSION = "2.20.2"
# peer name -> TE's cp_comm_type (DotProductAttention.set_context_parallel_group)
TE_PEERS = {"te_p2p": "p2p", "te_a2a": "a2a", "te_all_gather": "all_gather"}
BASELINE = "te_p2p"   # the ratios ours / TE are taken against TE's p2p ring
RECIPE = ("On the lent GPU machines: `bash tools/te_wheels.sh` here, carry each .te/part.* in back-to-back device "
          "calls (run's carry: [\".te\"]); tools/gpu_install.sh joins them, builds transformer_engine_torch with nvcc "
          "into /tmp/te_site and exports SPX_TE_SITE. Elsewhere: `pip install --no-build-isolation "
          f"transformer_engine[pytorch]=={TE_VERSION}` in a venv of its own. See docs/te_peer.md.")
# the variables torchrun gives its workers: a TE job started from inside a bench_cp rank must not inherit them
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_PREFIXES = ("TORCHELASTIC_", "PET_")


def parse_peers(text: str) -> list:
    """``--peers`` -> the peer names in order ("" -> []; "te" -> all three). SPConfigError on an unknown name."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["te"]:
        return list(TE_PEERS)
    bad = [n for n in names if n not in TE_PEERS]
    if bad:
        raise SPConfigError(f"--peers {text!r}: unknown peer {', '.join(bad)}; valid: te (all three), "
                            f"{', '.join(TE_PEERS)} (comma list)")
    if len(set(names)) != len(names):
        raise SPConfigError(f"--peers {text!r} names a peer twice")
    return names


def check_grid(peers: Sequence[str], heads: Sequence[int], seqlens: Sequence[int], world: int) -> None:
    """The rows every peer can run: TE's load-balanced split cuts the sequence into 2P chunks (--seqlens % 2P), and
    its a2a scatters the heads (--heads % P). SPConfigError naming the flag otherwise."""
    if not peers:
        return
    if world < 2:
        raise SPConfigError(f"--peers {','.join(peers)} needs at least 2 ranks (torchrun --nproc-per-node >= 2); "
                            f"this job has {world}")
    bad_l = [L for L in seqlens if L % (2 * world)]
    if bad_l:
        raise SPConfigError(f"--seqlens {','.join(map(str, bad_l))}: TE's context parallelism splits the sequence "
                            f"into 2 x P = {2 * world} equal chunks; use multiples of {2 * world}")
    if "te_a2a" in peers:
        bad_h = [h for h in heads if h % world]
        if bad_h:
            raise SPConfigError(f"--heads {','.join(map(str, bad_h))} with --peers te_a2a: TE's a2a scatters the "
                                f"heads over the P = {world} ranks; use multiples of {world} or leave te_a2a out")


def find_te(environ: Mapping[str, str]) -> Optional[str]:
    """Where the TE job finds Transformer Engine: ``SPX_TE_SITE`` (a --target folder, put first on its PYTHONPATH)
    when set, else None when ``transformer_engine`` is importable here (a normal install). TE is not imported.
    SPConfigError with the install recipe when neither."""
    site = environ.get("SPX_TE_SITE", "")
    if site:
        missing = [p for p in ("transformer_engine", f"transformer_engine-{TE_VERSION}.dist-info",
                               f"transformer_engine_torch-{TE_VERSION}.dist-info")
                   if not os.path.isdir(os.path.join(site, p))]
        # the sdist's build puts its extension under transformer_engine/wheel_lib/ (its framework_extension_only)
        ext = glob.glob(os.path.join(site, "transformer_engine", "wheel_lib", "transformer_engine_torch*.so"))
        if missing or not ext:
            what = missing + ([] if ext else ["transformer_engine/wheel_lib/transformer_engine_torch*.so"])
            raise SPConfigError(f"--peers: SPX_TE_SITE={site} lacks {', '.join(what)} (an unfinished install). "
                                + RECIPE)
        return site
    if importlib.util.find_spec("transformer_engine") is not None:
        return None
    raise SPConfigError("--peers te_*: Transformer Engine is not installed (SPX_TE_SITE is unset and "
                        "`transformer_engine` does not import here). " + RECIPE)


def torch_cudnn_home() -> Optional[str]:
    """The folder of the cuDNN torch loads (its ``nvidia-cudnn`` wheel: ``<site>/nvidia/cudnn``), or None (a torch
    built against a system cuDNN). TE 2.20 loads ``libcudnn`` from ``$CUDNN_HOME`` first, then CUDA_HOME,
    /usr/local/cuda and the loader's path: on the lent H100s (2026-11-28) that found the image's cuDNN 9.14 while
    torch 2.11 ships 9.19, and torch then refused every cuDNN call ("cuDNN version incompatibility"). Pointing
    CUDNN_HOME here makes TE and torch share one cuDNN."""
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):   # no ``nvidia`` package at all: find_spec raises for the parent
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    home = list(spec.submodule_search_locations)[0]
    return home if glob.glob(os.path.join(home, "lib", "libcudnn.so*")) else None


def mapped_cudnn(maps_text: str) -> list:
    """The ``libcudnn.so*`` files (the main library, not its ``libcudnn_*`` parts) mapped in a process, from the
    text of its ``/proc/<pid>/maps``, in order of first appearance."""
    found = []
    for line in maps_text.splitlines():
        path = line.split(None, 5)[5].strip() if len(line.split(None, 5)) == 6 else ""
        path = path[:-len(" (deleted)")] if path.endswith(" (deleted)") else path   # replaced on disk while mapped
        if os.path.basename(path).startswith("libcudnn.so") and path not in found:
            found.append(path)
    return found


def cudnn_parts(libcudnn: str) -> list:
    """The cuDNN parts beside ``libcudnn`` (its ``libcudnn_<part>.so.<major>`` files, one per part), the graph
    part first (the others need it), then by name."""
    folder = os.path.dirname(libcudnn)
    names = {os.path.basename(f) for f in glob.glob(os.path.join(folder, "libcudnn_*.so.*"))}
    parts = sorted(n for n in names if n.split(".so.", 1)[1].isdigit())
    return [os.path.join(folder, n) for n in sorted(parts, key=lambda n: (not n.startswith("libcudnn_graph."), n))]


def preload_cudnn_parts(libcudnn: str, load=None) -> dict:
    """Load every part of the cuDNN ``libcudnn`` (``cudnn_parts``) into this process, globally, before TE: TE's core
    library asks the loader for the parts by name, and on 2026-11-28 (lent H200s) the loader took the image's 9.14
    ``libcudnn_heuristic.so.9`` from /lib beside torch's 9.19 graph part ("undefined symbol ... libcudnn_graph.so.9"),
    so TE did not import. A part already loaded is what the loader gives for that name. ``load``: the loader
    (default ``ctypes.CDLL(path, RTLD_GLOBAL)``). Returns {loaded: [paths], failed: {path: error}}."""
    if load is None:
        import ctypes   # noqa: PLC0415
        load = lambda path: ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)   # noqa: E731
    done, failed = [], {}
    todo = cudnn_parts(libcudnn)
    while todo:   # a part whose needs are not loaded yet is tried again after the others
        left = []
        for path in todo:
            try:
                load(path)
                done.append(path)
            except OSError as e:
                left.append(path)
                failed[path] = str(e)
        if len(left) == len(todo):
            break
        todo = left
    return {"loaded": done, "failed": {p: failed[p] for p in todo}}


def share_torch_cudnn(environ, maps_path: str = "/proc/self/maps") -> dict:
    """Make the TE about to be imported in THIS process load the cuDNN torch loads. Call before importing TE.

    torch's cuDNN is loaded first (``torch.backends.cudnn.version()`` on a CUDA machine), then ``CUDNN_HOME`` is
    set to a new folder holding one link to the ``libcudnn.so*`` now mapped (TE 2.20 globs ``$CUDNN_HOME/**``
    before CUDA_HOME and /usr/local/cuda; a file already loaded is not loaded twice), else to
    ``torch_cudnn_home()``. On 2026-11-28 (lent H100s)
    TE loaded the image's cuDNN 9.14 first and torch (built with 9.19) refused every cuDNN call after it; pointing
    ``CUDNN_HOME`` at torch's package only where it was unset did not help (an image's own ``CUDNN_HOME`` is one
    way that happens). So a ``CUDNN_HOME`` already set is replaced by the folder torch loaded from (kept only when
    torch has no cuDNN mapped) and its old value recorded. With torch's cuDNN mapped, its parts are loaded too
    (``preload_cudnn_parts``; what loaded is under "parts"). Returns what it saw, for the job's meta:
    {torch_cudnn, mapped, CUDNN_HOME, replaced, source[, parts]}."""
    import torch   # noqa: PLC0415 - only where TE is about to be imported
    seen = {**cudnn_state(maps_path, load=torch.cuda.is_available()), "CUDNN_HOME": environ.get("CUDNN_HOME"),
            "replaced": None, "source": "as set"}
    if seen["mapped"]:   # a folder of one link to that file: TE's glob can find nothing else (a system folder may
        # hold several cuDNNs, sorted by name as text), and the loader takes a link to a loaded file as that file
        home, seen["source"] = tempfile.mkdtemp(prefix="spx_cudnn_"), "mapped by torch"
        os.symlink(seen["mapped"][0], os.path.join(home, os.path.basename(seen["mapped"][0])))
        seen["parts"] = preload_cudnn_parts(seen["mapped"][0])
    elif "CUDNN_HOME" in environ:
        return seen
    else:
        home, seen["source"] = torch_cudnn_home(), "torch's nvidia-cudnn package"
    if not home:
        seen["source"] = "none found: TE searches CUDA_HOME, /usr/local/cuda, the loader's path"
        return seen
    if environ.get("CUDNN_HOME") not in (None, home):
        seen["replaced"] = environ["CUDNN_HOME"]
    environ["CUDNN_HOME"] = seen["CUDNN_HOME"] = home
    return seen


def cudnn_state(maps_path: str = "/proc/self/maps", load: bool = True) -> dict:
    """{torch_cudnn: the version torch reports (None unless ``load``; its error as text: a clash), mapped: the
    ``libcudnn.so*`` files mapped in this process (two = two cuDNNs)}. ``load``: ask torch (which loads its cuDNN)."""
    import torch   # noqa: PLC0415
    version = None
    if load:
        try:
            version = torch.backends.cudnn.version()
        except RuntimeError as e:
            version = f"error: {e}"
    try:
        with open(maps_path) as f:
            mapped = mapped_cudnn(f.read())
    except OSError:
        mapped = []
    return {"torch_cudnn": version, "mapped": mapped}


def cudnn_after_te(maps_path: str = "/proc/self/maps") -> dict:
    """After TE's import: ``cudnn_state`` (torch asked)."""
    return cudnn_state(maps_path)


def te_script_args(args, peers: Sequence[str], out_json: str) -> list:
    """tools/bench_cp_te.py's arguments for the rows of bench_cp's ``args`` (heads, seqlens, head_dim, causal,
    links, iters, warmup)."""
    return ["--peers", ",".join(peers), "--heads", args.heads, "--seqlens", args.seqlens,
            "--head-dim", str(args.head_dim), "--causal", args.causal, "--links", args.links,
            "--iters", str(args.iters), "--warmup", str(args.warmup), "--out-json", out_json]


def te_command(python: str, nproc: int, script: str, script_args: Sequence[str]) -> list:
    """The TE job: its own torchrun (a free port: --standalone) with ``nproc`` ranks, one per GPU."""
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script,
            *script_args]


def te_env(environ: Mapping[str, str], site: Optional[str], repo_root: str) -> dict:
    """The TE job's environment: ``environ`` without torchrun's worker variables, PYTHONPATH = ``site`` (TE first,
    when given), the repository root, then the rest."""
    env = {k: v for k, v in environ.items()
           if k not in TORCHRUN_VARS and not k.startswith(TORCHRUN_PREFIXES)}
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    head = ([site] if site else []) + [repo_root]
    env["PYTHONPATH"] = os.pathsep.join(head + [p for p in path if p not in head])
    return env


def row_key(row: Mapping) -> tuple:
    """What makes two sides' rows the same row."""
    return (row["P"], row["H"], row["L"], row["D"], bool(row["causal"]), row["links"])


def add_te_ratios(row: dict, baseline: str = BASELINE) -> dict:
    """Each measured mode's time over ``baseline``'s (``vs_te_p2p_fwd`` / ``vs_te_p2p_fwd_bwd``; < 1: faster than
    TE's ring), and ``row["auto_vs_te_p2p"]`` when both ``auto`` and the baseline ran."""
    base = row["modes"].get(baseline, {})
    if "fwd_bwd_ms" not in base:
        return row
    tag = "vs_" + baseline
    for name, e in row["modes"].items():
        if name == baseline or "fwd_bwd_ms" not in e:
            continue
        e[tag + "_fwd"] = e["fwd_ms"] / base["fwd_ms"]
        e[tag + "_fwd_bwd"] = e["fwd_bwd_ms"] / base["fwd_bwd_ms"]
    auto = row["modes"].get("auto", {})
    if "fwd_bwd_ms" in auto:
        row["auto_" + tag] = {"fwd": auto[tag + "_fwd"], "fwd_bwd": auto[tag + "_fwd_bwd"]}
    return row


def merge_te_rows(rows: list, te_doc: Optional[Mapping], peers: Sequence[str], why_missing: str = "") -> list:
    """Our ``rows`` with each TE row's peer entries added (ratios to OUR row's floors, cuDNN and FA4 when timed,
    then ``add_te_ratios``). A
    peer without a TE entry for a row gets {"error": ...} (``why_missing``: what the TE job reported)."""
    by_key = {row_key(r): r for r in (te_doc or {}).get("rows", [])}
    for row in rows:
        te_row = by_key.get(row_key(row))
        for name in peers:
            entry = dict((te_row or {}).get("modes", {}).get(name) or
                         {"error": why_missing or "the TE job wrote no row for this shape"})
            if "fwd_bwd_ms" in entry:
                add_ratios(entry, row["floor"])
                add_ratios(entry, row.get("floor_fa4", {}), tag="fa4")
            row["modes"][name] = entry
        add_te_ratios(row)
    return rows
