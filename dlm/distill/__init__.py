"""`dlm distill`: few-step students from a trained teacher, on `dlm.train`'s loop, checkpoints and dashboards."""
