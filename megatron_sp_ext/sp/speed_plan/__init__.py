"""The speed plan's model: how long each sequence-parallel mode takes for one attention call on a cluster, computed
from the schedules the modes build (``schedules``), a measured kernel-rate table (``rates``) and the cluster's links
(``cluster``), overlapped as the code overlaps them (``timeline``); ``plan`` predicts and ranks, ``auto`` is what the
factory's ``auto`` asks of it across machines. It lives beside the modes it reads (sp/) so the factory can use it;
the command line, ``--validate`` and ``--table`` are the top-level package ``megatron_sp_ext.speed_plan``."""
from .cluster import COPY_TBPS, PRESETS, Cluster, Link, Probe, nic
from .plan import Prediction, candidates, padded_tokens, predict, predict_all, rank_modes, separable
from .rates import Call, KernelRates, package_rates
from .schedules import Problem, Setting

__all__ = ["COPY_TBPS", "PRESETS", "Call", "Cluster", "KernelRates", "Link", "Prediction", "Probe", "Problem",
           "Setting", "candidates", "nic", "package_rates", "padded_tokens", "predict", "predict_all", "rank_modes",
           "separable"]
