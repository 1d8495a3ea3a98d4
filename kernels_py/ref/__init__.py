"""Plain-PyTorch references for every kernel in kernels_py.triton."""
