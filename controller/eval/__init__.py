"""Offline evaluations of the controller's demand models on traces (run by `tierplan eval ...`)."""
