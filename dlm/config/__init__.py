"""Experiment configuration: the pydantic sections, their cross-field rules, the optimizer registry (torch-free)."""
