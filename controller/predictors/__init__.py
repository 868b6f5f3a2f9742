"""Demand models of the controller: one predictor per file, trained online (pure Python, no torch)."""
