"""Adapters plugging the agent into an engine: ours (`reference`) now, vLLM later."""
