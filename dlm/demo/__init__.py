"""dlm demo: the one-command demo, its time-budgeted training, its baseline."""
