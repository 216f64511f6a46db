"""The speed plan: how long each sequence-parallel mode takes for one attention call on a cluster, computed from the
schedules the modes build, a measured kernel-rate table and the cluster's links, overlapped as the code overlaps them
(the model: ``megatron_sp_ext.sp.speed_plan``; here: its public names, the command line, ``validate``, ``table``).

    from megatron_sp_ext import speed_plan as sp
    pb = sp.Problem(tokens=300_000, heads=40)
    cl = sp.Cluster(4, 8, sp.PRESETS["nvlink_large"], sp.nic(400))
    for p in sp.predict_all(pb, cl)[0]: print(p.line())
    sp.rank_modes(pb, cl)[:3]          # auto's ranking; sp.separable(ranking, 0.1): what it must still time

    python -m megatron_sp_ext.speed_plan --help      (--validate: every committed row; --table: docs/choosing_a_mode.md)
"""
from ..sp.speed_plan import (COPY_TBPS, PRESETS, Call, Cluster, KernelRates, Link, Prediction, Probe, Problem,
                             Setting, candidates, nic, package_rates, padded_tokens, predict, predict_all, rank_modes,
                             separable)

__all__ = ["COPY_TBPS", "PRESETS", "Call", "Cluster", "KernelRates", "Link", "Prediction", "Probe", "Problem",
           "Setting", "candidates", "nic", "package_rates", "padded_tokens", "predict", "predict_all", "rank_modes",
           "separable"]
