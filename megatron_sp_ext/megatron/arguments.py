"""Launch-script flags for Megatron-LM (``extra_args_provider``) and their validation.

    from megatron_sp_ext.megatron import add_arguments
    pretrain(..., extra_args_provider=add_arguments)              # older Megatron-LM
    parse_and_validate_args(extra_args_provider=add_arguments)    # newer Megatron-LM

Flags: --hcms-head-chunks, --sp-arrangement (--sp-placement), --sp-nodes, --sp-ulysses-size, --sp-ring-variant,
--sp-attention-backend, --dynamic-context-parallel / --min-dynamic-context-parallel-size (Megatron-LM's names:
each packed sample over an aligned sub-group of CP ranks sized to its length); Megatron-LM's
``--attention-dropout`` is applied by ulysses/hcms (and auto, which then stays on them) and refused by the
ring-family types; ``--cp-comm-type`` itself is Megatron-LM's (added here only when the parser lacks it, e.g. in
megatron-core-only scripts). Bad combinations fail when the arguments are
parsed, with one line naming the flag.
"""
from __future__ import annotations

import argparse
import os

from .. import modes
from ..config import ARRANGEMENTS, BACKENDS, DYNAMIC_MODES, RING_VARIANTS, SPConfig, parse_head_chunks
from ..errors import SPConfigError

OURS = modes.NAMES   # the mode registry's
TE = ("p2p", "a2a", "all_gather", "a2a+p2p")


def _chunks(value: str):
    try:
        return parse_head_chunks(value, "--hcms-head-chunks")
    except SPConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our flags (idempotent; skips flags the parser already has) and validate after parsing."""
    have = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public query
    g = parser.add_argument_group("megatron_sp_ext", "sequence-parallel attention (megatron_sp_ext)")

    def add(flag, **kw):
        if flag not in have:
            g.add_argument(flag, **kw)
    add("--cp-comm-type", nargs="+", type=str, default=["p2p"],
        help="context-parallel algorithm, one value or one per layer: " + ", ".join(OURS + TE))
    add("--hcms-head-chunks", type=_chunks, default=1,
        help="HCMS: head chunks per rank pipelined against the all-to-alls (int or 'auto', default 1 = plain Ulysses)")
    if "--sp-arrangement" not in have and "--sp-placement" not in have:
        g.add_argument("--sp-arrangement", "--sp-placement", dest="sp_arrangement", choices=ARRANGEMENTS,
                       default="auto", help="mesh arrangement for usp/tas/torus: usp = Ulysses inside machines, tas = "
                       "Ulysses across (StreamFusion), auto = by the inter-machine volume model (--sp-placement: its "
                       "older name)")
    add("--sp-nodes", type=int, default=None,
        help="machines to assume for the mesh (default: detect); set it to simulate machines on one")
    add("--sp-ulysses-size", type=int, default=None, help="Ulysses degree of the mesh (default gcd(CP, heads))")
    add("--sp-ring-variant", choices=RING_VARIANTS, default="ring", help="ring algorithm inside ring/mesh modes")
    add("--sp-attention-backend", choices=BACKENDS, default="auto", help="local attention kernel")
    add("--sp-async-qkv", nargs="?", const="on", default="off",
        help="off (default); on: self-attention overlaps its Q/K/V and output projections with the Ulysses "
             "exchanges (--cp-comm-type ulysses/hcms, integer --hcms-head-chunks); allgather: QKV from a "
             "sequence all-gather and the QKV GEMM for this rank's heads instead of the q/k/v exchanges (same "
             "requirements; with --sp-transport symm_mem through torch's fused symm_mem matmuls); with "
             "--tensor-model-parallel-size > 1 (and --sequence-parallel) on/allgather run the TP x CP layer's "
             "pipelined / mixed (one all-gather and one reduce-scatter over TP x CP) form; auto: a runtime policy "
             "times Megatron's own attention path against those forms per shape (first calls) and keeps it unless "
             "a form is faster in a majority of interleaved rounds")
    add("--sp-transport", default="nccl",
        help="exchange transport of ulysses/hcms: nccl (default), symm_mem (copy-engine pulls between barrier kernels, torch symmetric memory) or copy_engine (copy-engine pulls ordered by stream-memory flags: no kernel at all)")
    add("--dynamic-context-parallel", action="store_true",
        help="packed samples: each sample over an aligned sub-group of CP ranks sized to its length (divisors of "
             "--context-parallel-size; short samples whole on one rank, no exchange), balanced per rank; the step "
             "equals CP=1 on the same pack. Needs packed samples; modes ulysses, hcms, ring, tasp, usp, auto")
    add("--min-dynamic-context-parallel-size", type=int, default=1,
        help="with --dynamic-context-parallel: the smallest sub-group a sample may get (a divisor of "
             "--context-parallel-size; default 1)")
    if not getattr(parser, "_spx_validating", False):
        parser._spx_validating = True
        inner = parser.parse_known_args

        def parse_known_args(args=None, namespace=None):
            ns, rest = inner(args, namespace)
            try:
                validate_args(ns)
            except SPConfigError as e:
                parser.error(str(e))
            return ns, rest
        parser.parse_known_args = parse_known_args
    return parser


def _nodes_hint(args) -> int:
    if getattr(args, "sp_nodes", None):
        return args.sp_nodes
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    from ..topology.emulate import emulated_machine_size  # noqa: PLC0415
    emulated = emulated_machine_size()  # machines emulated on one box (SPX_EMULATED_MACHINE_SIZE)
    if world and emulated:
        return max(1, int(world) // emulated)
    if world and local and int(local) > 0:
        return max(1, int(world) // int(local))
    nnodes = os.environ.get("NNODES") or os.environ.get("SLURM_NNODES")
    return int(nnodes) if nnodes else 1


def validate_args(args) -> SPConfig:
    """Check our flags against each other and Megatron's sizes; raise SPConfigError naming the flag."""
    types = args.cp_comm_type if isinstance(args.cp_comm_type, (list, tuple)) else [args.cp_comm_type]
    for t in types:
        if t not in OURS + TE:
            raise SPConfigError(f"--cp-comm-type={t!r} is invalid: choose one of {', '.join(OURS + TE)}")
    cfg = SPConfig(head_chunks=args.hcms_head_chunks, ring_variant=args.sp_ring_variant,
                   arrangement=getattr(args, "sp_arrangement", None) or getattr(args, "sp_placement", "auto"),
                   ulysses_size=args.sp_ulysses_size, nodes=args.sp_nodes,
                   backend=args.sp_attention_backend, transport=getattr(args, "sp_transport", "nccl"),
                   async_qkv=getattr(args, "sp_async_qkv", "off"),
                   dynamic=bool(getattr(args, "dynamic_context_parallel", False)), source="megatron")
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cfg.ulysses_size is not None and hasattr(args, "context_parallel_size") and cp % cfg.ulysses_size:
        raise SPConfigError(f"--sp-ulysses-size={cfg.ulysses_size} must divide --context-parallel-size {cp}")
    if cfg.dynamic:
        for t in types:  # each of our types must run on a sub-group (SPConfig names both flags)
            if t in OURS:
                cfg.for_mode(t)
            else:
                raise SPConfigError(f"--cp-comm-type={t} is Transformer Engine's context parallelism: --dynamic-"
                                    f"context-parallel runs megatron_sp_ext's modes ({', '.join(DYNAMIC_MODES)})")
    floor = getattr(args, "min_dynamic_context_parallel_size", 1)
    if floor != 1 and not cfg.dynamic:
        raise SPConfigError("--min-dynamic-context-parallel-size applies to --dynamic-context-parallel: add it")
    if cfg.dynamic and (not isinstance(floor, int) or floor < 1 or cp % floor):
        raise SPConfigError(f"--min-dynamic-context-parallel-size={floor} is invalid: use a divisor of "
                            f"--context-parallel-size {cp}")
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    heads = getattr(args, "num_attention_heads", None)
    if heads is not None:
        local = heads // tp
        per_rank = [t for t in types if t in OURS and modes.get(t).heads_per_rank]
        if per_rank:
            if cp > 1 and local < cp:
                raise SPConfigError(f"--cp-comm-type={per_rank[0]} needs at least one head per CP rank: "
                                    f"{heads} heads / TP {tp} = {local} < --context-parallel-size {cp}")
            if isinstance(cfg.head_chunks, int) and cp > 1 and cfg.head_chunks > local // cp:
                raise SPConfigError(f"--hcms-head-chunks={cfg.head_chunks} exceeds the heads per rank "
                                    f"({local} heads per TP rank / CP {cp} = {local // cp}): use 1..{local // cp} or auto")
        if cfg.ulysses_size is not None and (cp % cfg.ulysses_size or local % cfg.ulysses_size):
            raise SPConfigError(f"--sp-ulysses-size={cfg.ulysses_size} must divide --context-parallel-size {cp} "
                                f"and the heads per TP rank {local}")
    dropout = getattr(args, "attention_dropout", 0.0) or 0.0  # Megatron-LM's --attention-dropout (default 0.1)
    if dropout:
        for t in types:  # each of our types applies it (Ulysses family) or refuses it, naming the flags
            if t in OURS:
                layer = cfg.for_mode(t, dropout_p=dropout)
                layer.check_dropout(cp, heads // tp if heads is not None else None)
    if cfg.nodes is not None and cp % cfg.nodes:
        raise SPConfigError(f"--sp-nodes={cfg.nodes} does not divide --context-parallel-size {cp}")
    across = [t for t in [*types, cfg.arrangement] if modes.find(t) is not None and modes.get(t).ulysses_across]
    if across and _nodes_hint(args) < 2:
        within = "/".join(modes.names(arrangement=True, ulysses_across=False) + ("auto",))
        raise SPConfigError(f"--cp-comm-type/--sp-arrangement {across[0]} needs a multi-machine mesh: this job runs on "
                            f"one machine; set --sp-nodes N to simulate N machines, or use {within}")
    return cfg
