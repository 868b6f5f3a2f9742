"""Offline evaluation of the controller's demand models on recorded traces (pure Python + numpy; never torch)."""
