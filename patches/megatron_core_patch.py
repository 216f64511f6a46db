"""Runtime patch for megatron.core (see megatron_sp_ext/megatron/patch.py for what and why).

    import patches.megatron_core_patch as p   # or: from megatron_sp_ext.megatron import patch as p
    p.apply()    # GPT layer-spec factories now return SPDotProductAttention
    p.remove()   # back to the originals
"""
from megatron_sp_ext.megatron.patch import apply, is_applied, remove  # noqa: F401
