"""Pallas GPU kernels: one backend per sub-package, each self-contained."""
