"""Expert slot pool over virtual memory: CUDA VMM on a GPU, memfd + mmap on the CPU twin."""
