"""LoRA fine-tuning of diffusers' WanTransformer3DModel through diffusers' own adapter API (peft): the adapters are
added with ``model.add_adapter(LoraConfig(...))`` (peft freezes every base weight), only they are trained,
checkpointed (training/video_dit/checkpoint.py, trainable parameters only) and written by ``save_lora`` in the format
``WanPipeline.load_lora_weights`` reads: ``get_peft_model_state_dict`` -> ``WanPipeline.save_lora_weights`` with
the adapter's LoraConfig as metadata (rank and alpha travel with the file), as diffusers' LoRA training examples do.

    add_lora(model, LoraSettings(rank=32, alpha=32, targets=DEFAULT_TARGETS))   # before parallelize / FSDP2
    save_lora(model, "runs/lora", rank)     # collective; pipe.load_lora_weights("runs/lora") reads it back
                                            # (the low-noise expert of Wan 2.2 A14B: load_into_transformer_2=True)

Parameters outside the adapters that still train (the top-k sparse plan's gates, added after the adapters) are
written beside them to megatron_sp_ext_extra.safetensors (diffusers' dense attention has no use for them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_sp_ext.errors import SPConfigError

from .model import written_on_rank0

# Wan's attention (self and cross: to_q / to_k / to_v / to_out.0) and FFN (ffn.net.0.proj, ffn.net.2) linears
DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
EXTRA = "megatron_sp_ext_extra.safetensors"
ADAPTER = "default"   # diffusers' add_adapter name


@dataclass(frozen=True)
class LoraSettings:
    """rank (r), alpha (lora_alpha: the update is scaled by alpha / rank), targets (module name suffixes)."""

    rank: int
    alpha: float
    targets: tuple = DEFAULT_TARGETS

    def describe(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


def parse_targets(text: str) -> tuple:
    """--lora-target-modules: a comma list of module names (suffixes, e.g. to_q,ffn.net.2)."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise SPConfigError(f"--lora-target-modules={text!r}: give a comma list of module names, e.g. "
                            f"{','.join(DEFAULT_TARGETS)}")
    return names


def add_lora(model: torch.nn.Module, settings: LoraSettings, seed: int) -> int:
    """Add one LoRA adapter to ``model`` (diffusers' add_adapter; its initialisation drawn from ``seed``, the same on
    every rank); every base weight is then frozen. Returns the number of adapted Linear modules. SPConfigError
    naming --lora-target-modules when a target matches no Linear of the model."""
    from peft import LoraConfig  # noqa: PLC0415
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in settings.targets:
        if not any(n == target or n.endswith("." + target) for n in names):
            raise SPConfigError(f"--lora-target-modules: {target!r} names no Linear of the model (Wan's are e.g. "
                                f"{', '.join(DEFAULT_TARGETS)}, add_k_proj, add_v_proj, proj_out)")
    torch.manual_seed(seed)
    model.add_adapter(LoraConfig(r=settings.rank, lora_alpha=settings.alpha, init_lora_weights=True,
                                 target_modules=list(settings.targets)), adapter_name=ADAPTER)
    return sum(1 for n, _ in model.named_modules() if n.endswith(f"lora_A.{ADAPTER}"))


def base_to_bf16(model: torch.nn.Module) -> None:
    """Store the frozen base weights in bf16 (the adapters, and the modules diffusers keeps in fp32 -
    ``_keep_in_fp32_modules`` - stay fp32): a LoRA run's weights as from_pretrained(torch_dtype=bfloat16) holds
    them."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, p in model.named_parameters():
        if not p.requires_grad and not any(k in name.split(".") for k in keep):
            p.data = p.data.to(torch.bfloat16)


def trainable(model: torch.nn.Module) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def save_lora(model: torch.nn.Module, out_dir: str, rank: int) -> dict:
    """Write the trained adapters of ``model`` to ``out_dir`` (pytorch_lora_weights.safetensors, keys
    "transformer.<module>.lora_A/B.weight", the LoraConfig as metadata) and any other trained parameters to
    megatron_sp_ext_extra.safetensors. Collective (FSDP2 shards gathered to rank 0's CPU); every rank raises the same
    SPConfigError when rank 0 cannot write. Returns {"adapters": n tensors, "extra": [names]} (rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: PLC0415
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=True))
    out = written_on_rank0(rank, lambda: _write_lora(model, full, out_dir),
                           f"--save-lora {out_dir}: could not write the adapters")
    return out if out is not None else {}


def _write_lora(model: torch.nn.Module, full: dict, out_dir: str) -> dict:
    from diffusers import WanPipeline  # noqa: PLC0415
    from peft.utils import get_peft_model_state_dict  # noqa: PLC0415
    lora = get_peft_model_state_dict(model, state_dict=full, adapter_name=ADAPTER)
    if not lora:
        raise SPConfigError(f"--save-lora {out_dir}: the model has no LoRA adapters (train with --lora-rank R > 0)")
    os.makedirs(out_dir, exist_ok=True)
    WanPipeline.save_lora_weights(out_dir, transformer_lora_layers={k: v.contiguous() for k, v in lora.items()},
                                  transformer_lora_adapter_metadata=model.peft_config[ADAPTER].to_dict(),
                                  safe_serialization=True)
    extra = sorted(k for k in full if "lora_" not in k)
    if extra:
        from safetensors.torch import save_file  # noqa: PLC0415
        save_file({k: full[k].contiguous() for k in extra}, os.path.join(out_dir, EXTRA))
    return {"adapters": len(lora), "extra": extra}


def lora_identity(settings: Optional[LoraSettings]) -> Optional[dict]:
    """run.json's "lora" (None: full fine-tuning)."""
    return settings.describe() if settings is not None else None
