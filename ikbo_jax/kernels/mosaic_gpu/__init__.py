"""Pallas Mosaic GPU kernels (`plgpu.kernel`) for Hopper: TMA, WGMMA, warp specialization."""
