"""Peer training scripts (plain DDP under torchrun, torchft) run by the benchmarks."""
