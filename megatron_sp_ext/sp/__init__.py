"""The sequence-parallel algorithms as autograd Functions."""
