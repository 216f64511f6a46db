"""The sequence-parallel algorithms, by family.

  ulysses/      all-to-all family: Ulysses, HCMS, packed q|k|v, the exchange engine, the chunk policy
  ring/         ring family: ring, TASP, hybrid (Ulysses x Ring), torus
  async_block   / gather_block: whole self-attention blocks built on the Ulysses engine; block_policy picks one
  factory       maps an SPConfig mode to its attention callable (every entry point uses it)
  dynamic/      dynamic SP for packed samples: the packer, the aligned sub-groups, per-sample sub-group attention
Shared below both families: checks (input / shape checks), heads (head splits), placement (which tokens
a rank holds), calibration (timing-based choices).
"""
