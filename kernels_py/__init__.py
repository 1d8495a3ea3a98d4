"""vlkv kernels: Triton kernels, their PyTorch references and the KV-cache
compression methods built on them. Imported by workers from the kernels root;
never installed into the runtime's virtual environment."""
