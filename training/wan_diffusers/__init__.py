"""Training diffusers' WanTransformer3DModel with megatron_sp_ext's sequence parallelism
(training/train_wan_diffusers.py): model presets and loading (model.py), Wan's flow-matching batches and loss
(flow.py), the step loop (loop.py)."""
