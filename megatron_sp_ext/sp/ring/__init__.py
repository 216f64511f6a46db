"""The ring family: K|V blocks travel around rings of ranks, partial results merge by log-sum-exp.

Modules (below them ``sp.checks``, ``sp.heads``, ``sp.placement``):
  schedule  what each ring step computes (kernel calls on contiguous slices, zigzag / tasp_zigzag layouts)
  rotation  the step transfers: starting a K|V hop; the backward's dK|dV partials sent home, last step per head chunk
  skips     under a block mask (``block_mask=``): the calls that select anything, the K|V hops a later rank needs
  ring      ``RingPlan``, ``ring_forward`` / ``ring_backward``, the one autograd Function, ``ring_attention``
            (``variant="ring"``: one ring; ``variant="tasp"``: the Hamiltonian multi-ring of TASP; dense or
            block-masked), ``RingBackend``
  sparse    ``sparse_ring_plan(...).counts``: the skip tables' counters, for benchmarks
  hybrid    Ulysses x Ring over an SPMesh (``hybrid_attention``)
  torus     StreamFusion's torus attention over an SPMesh (``torus_attention``)
"""
from .hybrid import hybrid_attention, mesh_runs
from .ring import VARIANTS, RingBackend, RingPlan, make_ring_plan, ring_attention, ring_backward, ring_forward
from .sparse import SparseRingPlan, sparse_ring_plan
from .torus import torus_attention

__all__ = ["ring_attention", "ring_forward", "ring_backward", "RingPlan", "RingBackend", "make_ring_plan", "VARIANTS",
           "hybrid_attention", "mesh_runs", "torus_attention", "SparseRingPlan", "sparse_ring_plan"]
