"""SPConfig: the one place that owns and validates every user-facing setting.

Every error names the setting exactly as the user wrote it: the Python keyword,
the Megatron-LM flag (``--hcms-head-chunks``) or the DeepSpeed JSON key
(``sequence_parallel_ext.head_chunks``), depending on where the config came from.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from . import modes
from .attention import kernels
from .attention.backends import backend_names
from .errors import SPConfigError

# every list of modes derives from the mode registry (modes.py)
MODES = modes.NAMES
RING_VARIANTS = modes.names(ring_variant=True)
ARRANGEMENTS = ("auto",) + modes.names(arrangement=True)   # the mesh arrangements (setting ``arrangement``)
BACKENDS = backend_names()   # "auto", "sdpa" and every kernel of the registry that can be a backend
TRANSPORTS = ("nccl", "symm_mem", "copy_engine")  # copy-engine exchanges (CUDA + NCCL only; checked at first use)
ASYNC_QKV = ("off", "on", "allgather", "auto")  # attention-layer forms (see SPConfig.async_qkv)
LAYOUTS = ("bshd", "sbhd")
SEQ_PLACEMENTS = ("contiguous", "zigzag", "tasp_zigzag")
# The ONE default sequence placement of every public function that takes or makes shards (shard_sequence,
# unshard_sequence, ulysses/ring/hybrid/torus/packed attention, make_attention): default shards are always right
# input for every default call. Load-balanced causal layouts ("zigzag", "tasp_zigzag") are passed explicitly.
DEFAULT_PLACEMENT = "contiguous"
MESH_MODES = modes.names(mesh=True)          # modes whose attention is a 2D mesh (Ulysses x Ring)
DROPOUT_MODES = modes.names(dropout=True, auto=False)   # modes that apply attention dropout ("auto" aside)
DYNAMIC_MODES = modes.names(dynamic=True)    # modes that run on the aligned sub-groups of dynamic SP

HeadChunks = Union[int, str]

resolve_auto_mode = modes.resolve_auto   # what mode "auto" runs for (num_heads, sp_size)

# setting -> (megatron flag, deepspeed json key)
_NAMES = {
    "mode": ("--cp-comm-type", "sequence_parallel_ext.mode"),
    "head_chunks": ("--hcms-head-chunks", "sequence_parallel_ext.head_chunks"),
    "ring_variant": ("--sp-ring-variant", "sequence_parallel_ext.ring_variant"),
    "arrangement": ("--sp-arrangement", "sequence_parallel_ext.arrangement"),
    "placement": ("--sp-placement", "sequence_parallel_ext.placement"),   # the older name of ``arrangement``
    "ulysses_size": ("--sp-ulysses-size", "sequence_parallel_ext.ulysses_size"),
    "nodes": ("--sp-nodes", "sequence_parallel_ext.nodes"),
    "backend": ("--sp-attention-backend", "sequence_parallel_ext.backend"),
    "transport": ("--sp-transport", "sequence_parallel_ext.transport"),
    "async_qkv": ("--sp-async-qkv", "sequence_parallel_ext.async_qkv"),
    "sp_size": ("--context-parallel-size", "sequence_parallel_size"),
    "dropout_p": ("--attention-dropout", "sequence_parallel_ext.dropout_p"),
    "dynamic": ("--dynamic-context-parallel", "sequence_parallel_ext.dynamic"),
}


def setting_name(setting: str, source: str) -> str:
    """The name of ``setting`` as the user wrote it, for ``source`` in python/megatron/deepspeed."""
    if source == "python" or setting not in _NAMES:
        return setting
    return _NAMES[setting][0 if source == "megatron" else 1]


def parse_head_chunks(value: Any, name: str = "head_chunks") -> HeadChunks:
    """``value`` as a positive int or the string "auto"; anything else raises naming ``name``."""
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return "auto"
        try:
            value = int(value)
        except ValueError:
            raise SPConfigError(f"{name}={value!r} is invalid: use a positive integer or 'auto'") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SPConfigError(f"{name}={value!r} is invalid: use a positive integer or 'auto'")
    return value


def _choice(value: Any, choices: tuple, name: str) -> str:
    if value not in choices:
        raise SPConfigError(f"{name}={value!r} is invalid: choose one of {', '.join(choices)}")
    return value


@dataclass
class SPConfig:
    """Sequence-parallel attention settings (validated on construction).

    mode: algorithm, one of ``MODES`` (the mode registry, modes.py: "ulysses", "hcms", "ring", "tasp", "usp",
        "tas", "torus", "auto").
    head_chunks: HCMS chunk count C per rank, or "auto" (calibrated per shape).
    ring_variant: ring algorithm inside ring/hybrid modes ("ring" or "tasp").
    arrangement: the 2D mesh arrangement ("auto", "usp", "tas"): how Ulysses and ring groups lie on machines
        (``placement``, --sp-placement and the JSON key "placement" are its older names, still taken; after
        construction ``placement`` is None: read ``arrangement``. The word "placement" is the sequence order.)
    ulysses_size: Ulysses degree P_u of the mesh (None = gcd(world, heads)).
    nodes: number of machines to assume (None = detect); lets one machine simulate several.
    backend: local attention kernel: "auto" (default; FlashAttention-4 for every call where it runs, else torch
        SDPA for plain calls and the fastest kernel with log-sum-exp for ring/TASP/Torus/hybrid/masked calls:
        cuDNN, FlashAttention-2, math), "fa4", "cudnn" or "torch_flash" (that kernel only; an error naming the
        reason where it does not run), "sdpa" (= auto),
        "math", "flash_attn", "te".
    transport: exchange transport: "nccl" (default), "symm_mem" (copy-engine pulls between barrier
        kernels) or "copy_engine" (copy-engine pulls ordered by stream-memory flags: no kernels); CUDA + NCCL.
    async_qkv: the attention layer's projections overlapped with their exchanges: "off", "on",
        "allgather" (QKV from a sequence all-gather fused with the QKV GEMM, no q/k/v exchange), or
        "auto" (a runtime policy times the forms per shape and keeps the baseline unless one is faster: video DiT
        plain/async/allgather x HCMS chunks x transports; Megatron layers their own attention path against the
        async/all-gather layers, or with TP > 1 the TP x CP layer's pipelined/mixed/mixed_in forms).
    dropout_p: attention dropout probability (Megatron's ``--attention-dropout``), applied in training by the
        Ulysses family (ulysses, hcms; "auto" then never picks the ring); refused by every other mode.
    dynamic: dynamic sequence parallelism for packed samples (Megatron-LM's --dynamic-context-parallel): each sample
        over an aligned sub-group of ranks sized to its length (megatron_sp_ext.sp.dynamic); modes in DYNAMIC_MODES.
    source: where the settings came from ("python", "megatron", "deepspeed"); errors use its names.
    """

    mode: str = "ulysses"
    head_chunks: HeadChunks = 1
    ring_variant: str = "ring"
    arrangement: str = "auto"
    ulysses_size: int | None = None
    nodes: int | None = None
    backend: str = "auto"
    transport: str = "nccl"
    async_qkv: str = "off"
    dropout_p: float = 0.0
    dynamic: bool = False
    placement: Optional[str] = field(default=None, repr=False)   # the older name of ``arrangement`` (None after init)
    source: str = field(default="python", repr=False)

    def __post_init__(self) -> None:
        n = lambda s: setting_name(s, self.source)  # noqa: E731
        self.mode = _choice(self.mode, MODES, n("mode"))
        self.head_chunks = parse_head_chunks(self.head_chunks, n("head_chunks"))
        self.ring_variant = _choice(self.ring_variant, RING_VARIANTS, n("ring_variant"))
        named = n("arrangement")
        if self.placement is not None:   # the older name: the same setting
            if self.arrangement not in ("auto", self.placement):
                raise SPConfigError(f"{n('arrangement')}={self.arrangement!r} and its older name {n('placement')}="
                                    f"{self.placement!r} are both set: give one of them")
            self.arrangement, named = self.placement, n("placement")
        self.arrangement = _choice(self.arrangement, ARRANGEMENTS, named)
        self.placement = None
        self.backend = _choice(self.backend, BACKENDS, n("backend"))
        self.transport = _choice(self.transport, TRANSPORTS, n("transport"))
        if self.transport != "nccl" and not modes.get(self.mode).all_to_all:
            a2a = "/".join(modes.names(all_to_all=True, auto=False))
            raise SPConfigError(f"{n('transport')}={self.transport!r} applies to the {a2a} exchanges only, "
                                f"not to {n('mode')}={self.mode!r}: use 'nccl' or a {a2a} mode")
        if self.async_qkv in (True, False):
            self.async_qkv = "on" if self.async_qkv else "off"
        self.async_qkv = _choice(self.async_qkv, ASYNC_QKV, n("async_qkv"))
        if self.async_qkv != "off" and self.source == "deepspeed":
            raise SPConfigError(f"{n('async_qkv')}={self.async_qkv!r} is not available through DeepSpeed's "
                                f"DistributedAttention (it receives q, k, v already projected): leave it 'off' and "
                                f"call the model's set_async_attention / set_layer_policy instead")
        for key in ("ulysses_size", "nodes"):
            val = getattr(self, key)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise SPConfigError(f"{n(key)}={val!r} is invalid: use a positive integer (or leave it unset)")
        fixed = modes.get(self.mode)
        if fixed.head_chunks is not None and self.head_chunks != fixed.head_chunks:
            # plain Ulysses with chunks is HCMS: accept and say nothing, the math is identical
            self.mode = fixed.with_chunks
        self.check_dropout()
        if not isinstance(self.dynamic, bool):
            raise SPConfigError(f"{n('dynamic')}={self.dynamic!r} is invalid: use true or false")
        if self.dynamic and self.mode not in DYNAMIC_MODES:
            raise SPConfigError(f"{n('mode')}={self.mode!r} cannot run with {n('dynamic')}: it places Ulysses across "
                                f"machines, which the sub-groups of one sample (aligned ranks of one machine) do not "
                                f"span; use {', '.join(DYNAMIC_MODES)}")

    def for_mode(self, mode: str, **changes: Any) -> "SPConfig":
        """A copy running ``mode`` (one layer's ``--cp-comm-type``) with the head chunks that mode runs (validated;
        errors name the user's settings); ``changes``: other fields to replace."""
        return dataclasses.replace(self, mode=mode, head_chunks=modes.get(mode).chunks(self.head_chunks), **changes)

    def check_dropout(self, sp_size: int | None = None, num_heads: int | None = None) -> None:
        """Refuse ``dropout_p`` > 0 where the mode cannot apply it (the ring family; "auto" where it would
        resolve to a mesh or the ring: ``num_heads`` < ``sp_size``), naming the setting and what works."""
        p, n = self.dropout_p, self.name("dropout_p")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise SPConfigError(f"{n}={p!r} is invalid: use a probability in [0, 1)")
        self.dropout_p = float(p)
        if p == 0.0:
            return
        ok = " or ".join(DROPOUT_MODES)
        fix = f"use {n} 0" if self.source == "megatron" else f"set {n}=0"
        kern = kernels.by_setting(self.backend)
        if kern is not None and not kern.caps.dropout:
            with_dropout = [k for k in BACKENDS if kernels.is_auto(k) or kernels.by_setting(k).caps.dropout]
            raise SPConfigError(
                f"{n}={p} is not supported by {self.name('backend')}={self.backend!r}: {kern.label} has no attention "
                f"dropout; {fix}, or use {self.name('backend')} {' or '.join(with_dropout)}")
        if not modes.get(self.mode).dropout:
            raise SPConfigError(
                f"{n}={p} is not supported by {self.name('mode')}={self.mode!r}: its attention is merged from "
                f"partial results (log-sum-exp), which cannot apply attention dropout; {fix}, or use "
                f"{self.name('mode')} {ok}")
        if modes.get(self.mode).auto and sp_size is not None and num_heads is not None and sp_size > 1 \
                and not modes.get(resolve_auto_mode(num_heads, sp_size)).dropout:
            raise SPConfigError(
                f"{n}={p} with {self.name('mode')}='auto' needs a head per rank ({num_heads} heads < "
                f"{self.name('sp_size')} {sp_size}: auto would run {resolve_auto_mode(num_heads, sp_size)}, which "
                f"cannot apply attention dropout); {fix}, or use fewer sequence-parallel ranks")

    def name(self, setting: str) -> str:
        """How the user spelled ``setting``."""
        return setting_name(setting, self.source)

    def validate_world(self, sp_size: int, world_size: int | None = None, num_heads: int | None = None) -> None:
        """Checks that need the SP degree (and optionally world size and heads)."""
        if sp_size < 1:
            raise SPConfigError(f"{self.name('sp_size')}={sp_size} is invalid: use a positive integer")
        if world_size is not None and world_size % sp_size != 0:
            raise SPConfigError(
                f"{self.name('sp_size')}={sp_size} does not divide the world size {world_size}: "
                f"use a divisor of {world_size}")
        if self.ulysses_size is not None and sp_size % self.ulysses_size != 0:
            raise SPConfigError(
                f"{self.name('ulysses_size')}={self.ulysses_size} does not divide the sequence-parallel "
                f"size {sp_size}: use a divisor of {sp_size}")
        if self.nodes is not None and sp_size % self.nodes != 0:
            raise SPConfigError(
                f"{self.name('nodes')}={self.nodes} does not divide the sequence-parallel size {sp_size}")
        self.check_dropout(sp_size, num_heads)
        if isinstance(self.head_chunks, int) and num_heads is not None and modes.get(self.mode).heads_per_rank:
            if num_heads >= sp_size and self.head_chunks > num_heads // sp_size:
                raise SPConfigError(
                    f"{self.name('head_chunks')}={self.head_chunks} exceeds the heads per rank "
                    f"({num_heads} heads / {sp_size} ranks = {num_heads // sp_size} on the smallest rank): "
                    f"use 1..{num_heads // sp_size} or 'auto'")

    @classmethod
    def from_dict(cls, section: Mapping[str, Any], source: str = "python",
                  adapter_keys: tuple[str, ...] = ()) -> "SPConfig":
        """Build from a dict; unknown keys raise naming the key. adapter_keys: keys the caller's adapter takes
        itself (listed among the valid keys; not in ``section``, e.g. DeepSpeed's ``causal``)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"source"}
        for key in section:
            if key not in known:
                prefix = "sequence_parallel_ext." if source == "deepspeed" else ""
                valid = ", ".join(sorted(known | set(adapter_keys)))
                raise SPConfigError(f"{prefix}{key} is not a known setting: valid keys are {valid}")
        return cls(**dict(section), source=source)

    @classmethod
    def from_deepspeed_config(cls, config: Union[str, Mapping[str, Any]]) -> "SPConfig":
        """From a DeepSpeed config (path or dict) with a ``sequence_parallel_ext`` section."""
        if isinstance(config, str):
            with open(config) as f:
                config = json.load(f)
        section = config.get("sequence_parallel_ext", {})
        if not isinstance(section, Mapping):
            raise SPConfigError("sequence_parallel_ext must be a JSON object")
        return cls.from_dict(section, source="deepspeed")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        d.pop("placement")   # the older name of arrangement (None after construction)
        return d
