"""Helpers of benchmark/quality_curve.py: artifacts (model, AP checkpoints, calibration), expert swapping,
policy plans at byte budgets, routing traffic, and the results file."""
