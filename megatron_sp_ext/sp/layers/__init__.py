"""Layers: whole self-attention layers (QKV projection -> sequence-parallel attention -> output projection)
with their exchanges overlapped, built on the Ulysses engine.

  call        a layer call's LayerWeights / LayerRun, the keyword forms' adapter and the cross-rank agreement
  async_qkv   per-branch q, k, v GEMMs, each branch's exchange started while the next one's GEMM runs
  allgather   the QKV exchange as a sequence all-gather fused with the QKV GEMM (this rank's heads only)
  tp_cp       tensor parallelism (TP sequence parallelism) x our context parallelism (Ulysses/HCMS)
  policy      LayerPolicy / FormPolicy: which layer form a shape runs, timed on the first call
  skeleton    the one autograd Function the three layers share (forward and backward halves per layer)
"""
