"""Demand models and expert-cache policies (controller process). Pure Python + numpy/sklearn/lightgbm; never torch."""
