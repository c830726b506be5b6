"""Weight formats: oneDNN-packed CPU linears, low-precision linears, GGUF Q4_1 blocks and GPTQ/AWQ checkpoints."""
