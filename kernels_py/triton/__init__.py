"""Triton kernels. Each has a plain-PyTorch reference in kernels_py.ref and a
test comparing the two under TRITON_INTERPRET=1."""
