"""The vision tower: its runner (eager, or CUDA graphs over patch buckets) and its
CPU kernels."""
