"""Plain-PyTorch reference implementations of every op: the oracle fused kernels are tested against.
CPU and CUDA; FP16/BF16/FP32 inputs accumulate in FP32, FP64 stays FP64."""
