"""``parallelize``: one call that makes a diffusers Wan transformer sequence parallel.

    from megatron_sp_ext.diffusers import parallelize
    sp = parallelize(model, group)                    # mode=None: "auto"; any mode of SPConfig, settings as
                                                      # keywords, or config= a ready SPConfig (no mode then)
    out = model(latent, timestep, text).sample        # every rank: the same full inputs (checked: check_inputs=),
                                                      # the same full output
    loss.backward(); all-reduce SUM each parameter's .grad over ``group``
    sp.remove()                                       # the model as it was

Sharding: the model's own ``_cp_plan`` (hooks.py): rope's (cos, sin) and blocks.0's hidden_states split along the
sequence, proj_out's output gathered, Wan 2.2 TI2V's per-token timestep [B, S] split. WanVACETransformer3DModel has
no ``_cp_plan``: it runs Wan's plan plus the split of its vace_blocks.0's hidden_states and control_hidden_states
(``plan_of``; its VACE layers only ever see that shard and their own outputs). Every self-attention
(``blocks.i.attn1``, and VACE's ``vace_blocks.i.attn1``) runs through ``make_attention(cfg, group, num_heads=H,
layout="bshd")`` (processor.py); the cross-attention (attn2: text, and Wan 2.1 I2V's image tokens) keeps diffusers'
own processor, locally (this rank's queries against the whole text).

Gradients: every SP rank computes the same loss on the gathered output; the gather's backward hands each rank the
gradient of its own tokens, so each rank's parameter gradients are its tokens' share, and the SP=1 gradient is their
SUM over the SP group: all-reduce SUM ``p.grad`` over ``group`` (then average over data-parallel replicas as usual).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import modes
from ..config import SPConfig
from ..errors import SPConfigError
from ..sp.factory import SPResources, make_attention
from .hooks import SequenceState, install_plan
from .processor import SPWanSelfAttnProcessor

SUPPORTED = ("WanTransformer3DModel", "WanVACETransformer3DModel")
# diffusers Wan models whose sharding this client does not carry out, and why (diffusers 0.42.1)
REFUSED = {
    "WanAnimateTransformer3DModel": "it has no _cp_plan and its face adapter attends per frame "
                                    "(WanAnimateFaceBlockAttnProcessor), not token-wise",
    "WanAnimate2Transformer3DModel": "it has no _cp_plan and its attention keeps a KV cache "
                                     "(WanAnimate2AttnProcessor)",
}
# every torch dropout (and its subclasses): refused anywhere in the model when p > 0
DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
            torch.nn.FeatureAlphaDropout)
SPARSE_MEMBERS = ("block_size", "token_order", "attach", "detach", "__call__")


@dataclass
class SPHandle:
    """What ``parallelize`` did to a model. config: the SPConfig; group: the SP group as given; sp_size; processors:
    the self-attention processors it set (blocks in order). ``remove()`` undoes it all and lets go of the group, the
    processors and the hooks (a removed handle keeps no process group alive past its destroy)."""

    model: torch.nn.Module = field(repr=False)
    config: SPConfig
    group: Optional[dist.ProcessGroup]
    sp_size: int
    processors: list = field(repr=False)
    attentions: list = field(default_factory=list, repr=False)
    sparse: Any = None
    hooks: list = field(default_factory=list, repr=False)
    removed: bool = False

    def remove(self) -> None:
        """Remove every hook, put the original processors back and detach the sparse plan's modules (idempotent)."""
        if self.removed:
            return
        for h in self.hooks:
            h.remove()
        for attn, proc in zip(self.attentions, self.processors):
            attn.set_processor(proc.original)
        if self.sparse is not None:
            self.sparse.detach(self.model)
        self.group, self.processors, self.attentions, self.hooks = None, [], [], []
        self.removed = True


DEFAULT_MODE = modes.names(auto=True)[0]   # parallelize's default mode: the registry's per-model choice


def _config(mode: Optional[str], config: Optional[SPConfig], settings: dict) -> SPConfig:
    """The SPConfig of ``parallelize``'s arguments: config= alone, or mode (None: DEFAULT_MODE) and settings."""
    if config is not None:
        if not isinstance(config, SPConfig):
            raise SPConfigError(f"parallelize: config= must be an SPConfig; got {type(config).__name__}")
        if mode is not None or settings:
            given = ([f"mode={mode!r}"] if mode is not None else []) + sorted(settings)
            raise SPConfigError(f"parallelize: give either config= or mode/settings, not both (got config= and "
                                f"{', '.join(given)}); the mode is config.mode")
        return config
    return SPConfig.from_dict({"mode": DEFAULT_MODE if mode is None else mode, **settings})


def self_attentions(model: torch.nn.Module) -> list:
    """(name, module) of every self-attention: blocks.i.attn1, then VACE's vace_blocks.i.attn1."""
    out = [(f"blocks.{i}.attn1", blk.attn1) for i, blk in enumerate(model.blocks)]
    return out + [(f"vace_blocks.{i}.attn1", blk.attn1) for i, blk in enumerate(getattr(model, "vace_blocks", ()))]


def plan_of(model: torch.nn.Module) -> dict:
    """The sequence plan: the model's ``_cp_plan``; for WanVACETransformer3DModel (none of its own) Wan's plus the
    split of vace_blocks.0's hidden_states and control_hidden_states (the other vace blocks take the previous one's
    sharded output and ignore hidden_states)."""
    from diffusers import WanTransformer3DModel  # noqa: PLC0415
    if type(model) is WanTransformer3DModel:
        return type(model)._cp_plan
    tokens = WanTransformer3DModel._cp_plan["blocks.0"]["hidden_states"]   # [B, S, C] split along dim 1
    return {**WanTransformer3DModel._cp_plan,
            "vace_blocks.0": {"hidden_states": tokens, "control_hidden_states": tokens}}


def _check_model(model: torch.nn.Module) -> None:
    name = type(model).__name__
    try:
        from diffusers import WanTransformer3DModel, WanVACETransformer3DModel  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - the client needs diffusers
        raise SPConfigError(f"parallelize needs diffusers (pip install 'diffusers>=0.42'): {e}") from None
    if type(model) not in (WanTransformer3DModel, WanVACETransformer3DModel):
        why = f" ({REFUSED[name]})" if name in REFUSED else ""
        raise SPConfigError(f"parallelize supports {', '.join(SUPPORTED)} (diffusers; Wan 2.1 / 2.2, T2V, I2V, TI2V); "
                            f"got {name}{why}")
    if getattr(model, "_parallel_config", None) is not None:
        raise SPConfigError(f"parallelize: this {name} already has diffusers' own context parallelism enabled "
                            f"(model.enable_parallelism / _parallel_config is set); use one of the two, on a model "
                            f"loaded without parallel_config")
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor  # noqa: PLC0415
    for where, attn in [(n, m) for n, m in model.named_modules() if hasattr(m, "processor")]:
        if getattr(attn.processor, "_parallel_config", None) is not None:
            raise SPConfigError(f"parallelize: {where}'s processor has diffusers' context parallelism set "
                                f"(_parallel_config); use one of the two")
    for where, attn in self_attentions(model):
        if isinstance(attn.processor, SPWanSelfAttnProcessor):
            raise SPConfigError(f"parallelize: this {name} is already parallelized ({where}): call remove() on its "
                                f"handle first")
        if type(attn.processor) is not WanAttnProcessor:
            raise SPConfigError(f"parallelize replaces diffusers' WanAttnProcessor of each self-attention; "
                                f"{where} has {type(attn.processor).__name__}")
        if attn.is_cross_attention or attn.add_k_proj is not None:
            raise SPConfigError(f"parallelize: {where} is not a plain self-attention (is_cross_attention="
                                f"{attn.is_cross_attention}, added k/v projections: {attn.add_k_proj is not None})")
    for where, module in model.named_modules():
        if isinstance(module, DROPOUTS) and module.p > 0:
            raise SPConfigError(f"parallelize: {where} is {type(module).__name__}(p={module.p}); on sharded tokens "
                                f"its random mask would differ from SP=1's; build the model with dropout 0 (or set "
                                f"{where}.p = 0)")


def _check_sparse(sparse: Any) -> None:
    missing = [m for m in SPARSE_MEMBERS if not hasattr(sparse, m)]
    if missing:
        raise SPConfigError(f"parallelize: sparse= must be a SparseAttentionPlan (block_size, token_order, attach, "
                            f"detach, __call__); {type(sparse).__name__} lacks {', '.join(missing)}")


ROPE_CHOICES = ("fused", "eager")   # parallelize's rope=: rope.py's kernels where they apply, or diffusers' ops


def parallelize(model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None, mode: Optional[str] = None, *,
                config: Optional[SPConfig] = None, sparse: Any = None, rope: str = "fused", check_inputs: bool = True,
                **settings: Any) -> SPHandle:
    """Shard ``model`` (a diffusers WanTransformer3DModel or WanVACETransformer3DModel) over the SP ``group`` and
    run every self-attention through ``make_attention``; returns the ``SPHandle``.

    group: the SP process group (None or one rank: no sharding, the same code path). mode / settings: SPConfig's
    fields (mode, head_chunks, backend, ring_variant, placement, ulysses_size, nodes, transport; mode None: the
    registry's automatic choice, ``DEFAULT_MODE``), or config= a ready SPConfig (then no mode and no settings).
    sparse: a SparseAttentionPlan (token order, block mask per layer, optional extra branch) or None. rope: "fused"
    (Wan's RoPE as one kernel per direction on CUDA where it applies, bit for bit diffusers' ops: rope.py) or
    "eager" (diffusers' ops). check_inputs: every forward checks that every rank of ``group`` was given the same
    inputs (latent, timestep, text and image embeddings, VACE's control video: one all_gather of a few float64 per
    rank and a host sync, inputs.py) and refuses different ones on every rank by name; False skips it (inputs equal
    by construction). Give it the same value on every rank.
    Every rank passes the same full inputs and gets the same full output; parameter gradients must be all-reduced
    (SUM) over ``group`` (module docstring). Raises SPConfigError naming the keyword or the model's part."""
    _check_model(model)
    if rope not in ROPE_CHOICES:
        raise SPConfigError(f"parallelize: rope={rope!r}; valid: {', '.join(map(repr, ROPE_CHOICES))}")
    if not isinstance(check_inputs, bool):
        raise SPConfigError(f"parallelize: check_inputs={check_inputs!r}; valid: True (default) or False")
    cfg = _config(mode, config, settings)
    sp_size = dist.get_world_size(group) if group is not None else 1
    sp_group = group if sp_size > 1 else None
    heads = model.config.num_attention_heads
    if cfg.dropout_p > 0:
        raise SPConfigError(f"parallelize: dropout_p={cfg.dropout_p}: diffusers' WanAttnProcessor runs attention "
                            f"without dropout; leave dropout_p=0")
    if cfg.async_qkv != "off" or cfg.dynamic:
        key = "async_qkv" if cfg.async_qkv != "off" else "dynamic"
        raise SPConfigError(f"parallelize: {key}={getattr(cfg, key)!r} applies to megatron_sp_ext's own attention "
                            f"blocks, not to a diffusers processor; leave it unset")
    cfg.validate_world(sp_size, num_heads=heads)
    if sparse is not None:
        _check_sparse(sparse)
        if hasattr(model, "vace_blocks"):
            raise SPConfigError(f"parallelize: sparse= (a SparseAttentionPlan keyed by the main blocks) is not "
                                f"available for {type(model).__name__}, whose vace_blocks have self-attentions of "
                                f"their own; leave sparse=None")
    # one rank (sp_group None): the factory's one-rank path (every mode is the local attention)
    attention = make_attention(cfg, sp_group, num_heads=heads, layout="bshd", resources=SPResources(cfg))
    state = SequenceState(sp_group, sp_size, sparse, tuple(model.config.patch_size), check_inputs)
    if sparse is not None:
        sparse.attach(model)
    attentions, processors = [], []
    for i, (where, attn) in enumerate(self_attentions(model)):
        proc = SPWanSelfAttnProcessor(attention, state, i, attn.processor, where, fused_rope=rope == "fused")
        attn.set_processor(proc)
        attentions.append(attn)
        processors.append(proc)
    handle = SPHandle(model, cfg, group, sp_size, processors, attentions, sparse)
    try:
        handle.hooks = install_plan(model, plan_of(model), state)
    except BaseException:
        handle.remove()   # the processors back, the plan's modules detached
        raise
    return handle
