"""Inter-machine communication volume per GPU of USP and TAS meshes (StreamFusion, Appendix D).

N machines x M GPUs, Ulysses degree P_u, Ring degree P_r (P_u * P_r = N * M), tensors [B, L, H, D].
Volumes are element counts per GPU for one attention layer's forward (q, k, v, o exchanges for
Ulysses, k and v around the ring for Ring).
  USP (Ulysses inside machines, Ring across):  P_r >= N: eq. 4;  P_r <= N: eq. 5.
  TAS (Ulysses across machines, Ring inside):  P_u >= N: eq. 6;  P_u <= N: eq. 7.
"""
from __future__ import annotations


def usp_volume(N: int, M: int, P_u: int, P_r: int, B: int, L: int, H: int, D: int) -> float:
    """Elements per GPU crossing machine boundaries under USP."""
    unit = B * L * H * D / N
    if N == 1:
        return 0.0
    if P_r >= N:
        return 2 * (N - 1) * unit                                        # eq. 4
    a = N / P_r
    return (2 * (P_r - 1) * a + 4 * (a - 1) / a) * unit                  # eq. 5


def tas_volume(N: int, M: int, P_u: int, P_r: int, B: int, L: int, H: int, D: int) -> float:
    """Elements per GPU crossing machine boundaries under TAS (StreamFusion's arrangement)."""
    unit = B * L * H * D / N
    if N == 1:
        return 0.0
    if P_u >= N:
        return 4 * (N - 1) / N * unit                                    # eq. 6
    return (2 * (N / P_u - 1) + 4 * (P_u - 1) / P_u * N / P_u) * unit    # eq. 7


def lemma_d1_diff(N: int, M: int, P_u: int) -> float:
    """(V_USP - V_TAS) / (BLHD/N) in closed form (Lemma D.1), valid for 2 <= M <= P_u <= N."""
    return 4 * N / P_u ** 2 - (4 * M + 6 * N) / P_u - 2 * P_u / M + 2 * N + 6


def arrangement_for(N: int, M: int, P_u: int, B: int = 1, L: int = 1, H: int = 1, D: int = 1) -> str:
    """"tas" when it moves strictly fewer bytes between machines, else "usp" (ties: usp, which
    overlaps its inter-machine ring traffic)."""
    P_r = N * M // P_u
    if N == 1:
        return "usp"
    return "tas" if tas_volume(N, M, P_u, P_r, B, L, H, D) < usp_volume(N, M, P_u, P_r, B, L, H, D) else "usp"
