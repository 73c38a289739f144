"""Triton kernels, one module per family; each has a pure-torch twin in `qmoe.reference`."""
