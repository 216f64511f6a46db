"""Video-DiT training with megatron_sp_ext sequence parallelism (Megatron-core and DeepSpeed)."""
