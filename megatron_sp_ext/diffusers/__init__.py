"""The diffusers client: ``parallelize(model, group, mode="auto")`` shards a diffusers WanTransformer3DModel's
sequence with the model's own ``_cp_plan`` (torch module hooks) and runs every self-attention through
``megatron_sp_ext.make_attention`` (docs/diffusers.md). diffusers itself is imported only when ``parallelize`` runs.

    from megatron_sp_ext.diffusers import parallelize
    sp = parallelize(model, group, mode="auto")    # -> SPHandle; sp.remove() undoes it
    sp = parallelize(model, group, sparse=BlockSparsePlan(topk=K))   # or window=(wt, wh, ww): block-sparse tiles
    keep_attention_checkpointing(sp)              # every block recomputed in the backward but its self-attention
    fused = fuse_elementwise(model)               # each block's elementwise work compiled (stock models too)
"""
from .fused import FusedLayers, fuse_elementwise
from .parallelize import SPHandle, parallelize
from .recompute import KeptAttention, keep_attention_checkpointing
from .sparse import BlockSparsePlan

__all__ = ["parallelize", "SPHandle", "BlockSparsePlan", "keep_attention_checkpointing", "KeptAttention",
           "fuse_elementwise", "FusedLayers"]
