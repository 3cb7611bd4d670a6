"""Scoring models: dlm eval, likelihood figures, harness scoring, unigram level, sample quality."""
