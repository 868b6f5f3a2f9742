"""Benchmarks: `tierplan bench ...` measures and writes bench/results/ (JSON, Markdown, PNG)."""
