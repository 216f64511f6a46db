"""The sequence-parallel algorithms, by family.

  ulysses/      all-to-all family: Ulysses, HCMS, packed q|k|v, the exchange engine, the chunk policy
  ring/         ring family: ring, TASP, hybrid (Ulysses x Ring), torus
  layers/       whole self-attention layers built on the Ulysses engine (async_qkv, allgather,
                tp_cp), one shared autograd skeleton, and the policy that picks a layer form
  factory       maps an SPConfig mode to its attention callable (every entry point uses it)
  dynamic/      dynamic SP for packed samples: the packer, the aligned sub-groups, per-sample sub-group attention
Shared below both families: problem (``describe``: one call's attention problem, validated once: the public
functions build it first), checks (input / shape / mask checks), heads (head splits), placement (which tokens a rank
holds), calibration (timing-based choices).
"""
