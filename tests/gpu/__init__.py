"""GPU correctness checks run as scripts on a GPU machine (``python tests/gpu/check_<x>.py --out DIR``, most of them
from tools/gpu_round.sh), beside the CUDA suite (tests/test_cuda.py); the CPU tests import some of them (their CPU
stand-in paths). Not pytest modules: pytest collects test_*.py only, and no file here is named so."""
