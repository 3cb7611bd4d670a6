"""The masking process: noise schedules and the training objective (math only, no model)."""
