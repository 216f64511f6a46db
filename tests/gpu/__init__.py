"""What runs on a GPU machine. The CUDA suite: test_cuda.py (``make test-gpu`` / ``bash tools/gpu_run.sh [-k expr]``;
skipped on CPU with the reason "needs CUDA"), its case families cuda_<family>.py (indexed in cuda_suite.py) and the
judge of their records, suite_judge.py; the CPU tests under tests/ dry-run those families on gloo ranks. And the GPU
correctness checks run as scripts (``python tests/gpu/check_<x>.py --out DIR``); the CPU tests import some of them
(their CPU stand-in paths)."""
