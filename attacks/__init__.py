"""Attacks that read captured artifacts (representation inversion, gradient leakage) and their metrics."""
