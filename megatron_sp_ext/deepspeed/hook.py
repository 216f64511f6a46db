"""The JSON switch: ``deepspeed.initialize`` installs our attention when the config asks for it.

A stock DeepSpeed script calls ``deepspeed.initialize(model=..., config=...)`` itself. After
``activate()``, that call first looks at the config (``config=``, ``config_params=`` or
``args.deepspeed_config``; dict or JSON path):

* no ``"sequence_parallel_ext"`` key: DeepSpeed's own initialize runs with the caller's arguments,
  untouched (nothing else is changed, nothing is imported from DeepSpeed beyond what it imports);
* the key is present: the section is validated (errors name the JSON key), then the model's
  DeepSpeed sequence-parallel attention is replaced, in place, by ours, and DeepSpeed's initialize
  runs with the caller's arguments:
    - every ``deepspeed.sequence.layer.DistributedAttention`` submodule becomes an
      ``SPDistributedAttention`` with the same local attention, group, scatter/gather indices and
      kv heads (modes: all of ours);
    - a ``UlyssesSPAttentionHF`` that ``UlyssesSPAttentionHF.register_with_transformers`` installed
      for the model's attention implementation is replaced, inside DeepSpeed's own wrapper, by
      ``SPUlyssesAttentionHF`` (modes ulysses, hcms: HF's local kernel keeps running).
  Finding neither is an error (the section would otherwise do nothing).

``activate()`` is called by ``megatron_sp_ext_autoload`` (imported by the ``.pth`` file installed
with the package, wheel or editable, when deepspeed is first imported) and by
``python -m megatron_sp_ext.deepspeed.launch``. Set ``MEGATRON_SP_EXT_DEEPSPEED_HOOK=0`` to turn the switch
off: ``deepspeed.initialize`` then refuses a config that holds the section (it would be ignored).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
from typing import Any, Optional

import torch

from .. import modes
from ..config import SPConfig, resolve_auto_mode
from ..errors import SPConfigError

log = logging.getLogger("megatron_sp_ext")

SECTION_KEY = "sequence_parallel_ext"
HF_MODES = modes.names(local_attention=True)   # Hugging Face's attention runs inside (it returns no log-sum-exp)


def config_of(args: Any, kwargs: dict) -> Optional[dict]:
    """The config deepspeed.initialize will use, as a dict (None when none is given)."""
    config = kwargs.get("config")
    if config is None:
        config = kwargs.get("config_params")
    if config is None and getattr(args, "deepspeed_config", None) is not None:
        config = args.deepspeed_config
    if config is None or isinstance(config, dict):
        return config
    if hasattr(config, "items"):
        return dict(config)
    try:
        with open(config) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None  # DeepSpeed reports its own error for an unreadable config (hjson, missing file)


def activate() -> None:
    """Wrap ``deepspeed.initialize`` (idempotent; replaces the start-up guard that refuses the section while the
    switch is off, ``megatron_sp_ext_autoload.guard``)."""
    import deepspeed  # noqa: PLC0415
    marker = getattr(deepspeed.initialize, "_megatron_sp_ext", False)
    if marker is True:
        return
    original = deepspeed.initialize.__wrapped__ if marker else deepspeed.initialize

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        config = config_of(args[0] if args else kwargs.get("args"), kwargs)
        if config is not None and SECTION_KEY in config:
            model = kwargs.get("model", args[1] if len(args) > 1 else None)
            install(model, config)
        return original(*args, **kwargs)

    initialize._megatron_sp_ext = True
    initialize.__wrapped__ = original
    deepspeed.initialize = initialize


def deactivate() -> None:
    """Undo ``activate()`` (tests)."""
    import deepspeed  # noqa: PLC0415
    if getattr(deepspeed.initialize, "_megatron_sp_ext", False):
        deepspeed.initialize = deepspeed.initialize.__wrapped__


def _sp_size(config: dict) -> int:
    sp = config.get("sequence_parallel_size")
    if sp is None:
        raise SPConfigError(f"{SECTION_KEY} needs \"sequence_parallel_size\" next to it (DeepSpeed's own key)")
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise SPConfigError(f"sequence_parallel_size={sp!r} is invalid: use a positive integer")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else None
    if world is not None and world % sp:
        valid = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise SPConfigError(f"sequence_parallel_size={sp} does not divide the world size {world} (the number of "
                            f"ranks): use one of {valid}")
    return sp


def install(model: Optional[torch.nn.Module], config: dict) -> int:
    """Validate the section and swap the model's DeepSpeed SP attention for ours; returns how many."""
    from .initialize import sp_config_from_deepspeed  # noqa: PLC0415
    section = config[SECTION_KEY]
    if not isinstance(section, dict):
        raise SPConfigError(f"{SECTION_KEY} must be a JSON object, e.g. {{\"mode\": \"hcms\"}}; got {section!r}")
    sp = _sp_size(config)
    cfg, extras = sp_config_from_deepspeed(config)
    if model is None:
        raise SPConfigError(f"{SECTION_KEY} is set but deepspeed.initialize got no model")
    n = _swap_distributed_attention(model, cfg, extras, sp) + _swap_hf_ulysses(model, cfg, sp)
    if n == 0 and sp == 1:  # DeepSpeed itself installs no SP attention at size 1 (e.g. a debugging run)
        log.info("megatron_sp_ext: sequence_parallel_size=1, %s has nothing to replace", SECTION_KEY)
        return 0
    if n == 0:
        raise SPConfigError(
            f"{SECTION_KEY} is set but the model has no DeepSpeed sequence-parallel attention to replace: "
            "use deepspeed.sequence.layer.DistributedAttention in the model, or call "
            "UlyssesSPAttentionHF.register_with_transformers(...) before deepspeed.initialize")
    log.info("megatron_sp_ext: %s attention installed in %d place(s) from the DeepSpeed config", cfg.mode, n)
    return n


def _check_group(group, sp: int, what: str) -> None:
    size = torch.distributed.get_world_size(group)
    if size != sp:
        raise SPConfigError(f"sequence_parallel_size={sp} differs from the size {size} of the sequence-parallel "
                            f"group of the model's {what}: make them equal")


def _swap_distributed_attention(model: torch.nn.Module, cfg: SPConfig, extras: dict, sp: int) -> int:
    from deepspeed.sequence.layer import DistributedAttention  # noqa: PLC0415

    from .attention import SPDistributedAttention  # noqa: PLC0415
    from .initialize import causal_of  # noqa: PLC0415
    ours = [m for m in model.modules() if isinstance(m, SPDistributedAttention)]  # installed by the script itself
    found = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, DistributedAttention) and not isinstance(child, SPDistributedAttention)]
    if found and modes.get(cfg.mode).auto:
        raise SPConfigError(f"{SECTION_KEY}.mode={cfg.mode!r} needs the head count, which DistributedAttention learns "
                            f"only in forward: use a concrete mode ({', '.join(modes.names(auto=False))})")
    for parent, name, child in found:
        _check_group(child.spg, sp, "DistributedAttention")
        causal = causal_of(cfg, extras, f"{type(parent).__name__}.{name}")
        setattr(parent, name, SPDistributedAttention(
            child.local_attn, child.spg, child.scatter_idx, child.gather_idx, None, child.num_kv_heads,
            sp_config=cfg, causal=causal))
    return len(found) + len(ours)


def _swap_hf_ulysses(model: torch.nn.Module, cfg: SPConfig, sp: int) -> int:
    """Replace the UlyssesSPAttentionHF inside DeepSpeed's wrapper for the model's attention implementation."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is None:
        return 0
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415

        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: PLC0415
    except ImportError:
        return 0
    fn = ALL_ATTENTION_FUNCTIONS.get(impl) if hasattr(ALL_ATTENTION_FUNCTIONS, "get") else None
    cells = [c for c in (getattr(fn, "__closure__", None) or ())
             if isinstance(_cell_value(c), UlyssesSPAttentionHF)]
    if not cells:
        return 0
    from .hf import SPUlyssesAttentionHF  # noqa: PLC0415
    if modes.get(cfg.mode).auto:
        heads = _cell_value(cells[0]).attn_head_count
        cfg = dataclasses.replace(cfg, mode=resolve_auto_mode(heads, sp))
    if cfg.mode not in HF_MODES:
        raise SPConfigError(f"{SECTION_KEY}.mode={cfg.mode!r} is not available with UlyssesSPAttentionHF "
                            f"(Hugging Face's attention kernels return no log-sum-exp): use one of {', '.join(HF_MODES)}")
    for cell in cells:
        theirs = cell.cell_contents
        if isinstance(theirs, SPUlyssesAttentionHF):
            continue
        _check_group(theirs.process_group, sp, "UlyssesSPAttentionHF")
        cell.cell_contents = SPUlyssesAttentionHF.from_deepspeed(theirs, cfg)
    return len(cells)


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None
