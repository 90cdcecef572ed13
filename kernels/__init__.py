"""Compute kernels. `kernels.cpu`: C++ CPU ops (paged prefill and decode attention, fused
elementwise ops), compiled on first use; the PyTorch paths in `engine` are the fallback wherever
they cannot be built."""
