"""GPU kernels of the reference engine (Triton), each with a torch reference it is tested against."""
