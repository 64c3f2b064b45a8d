"""What quantized bytes mean: GGML's block layouts as the kernels keep them, the blocks' dequantisation and the KV
cache storage types, in torch. Nothing here imports the rest of flashdraft, so kernels/, layers/, formats/ and
models/ all build on it."""
