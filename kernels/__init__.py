"""Compute kernels. `kernels.cpu`: a C++ paged decode-attention op for CPU, compiled on first
use; the PyTorch path in `engine.attention` is the fallback wherever it cannot be built."""
