"""tierplan runtime: the mechanism inside the inference process.

Expert slots over (CUDA or host) virtual memory, KV blocks on three tiers, and one transfer engine that
moves both. Mechanism only: nothing here decides a placement, and nothing here touches the network.
"""
