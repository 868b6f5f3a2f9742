"""Where non-resident experts come from: packed expert records in pinned host memory or on NVMe."""
