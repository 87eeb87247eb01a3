"""Pallas Triton kernels (`pl.pallas_call`), the portable second backend."""
