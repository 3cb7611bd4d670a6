"""Training: the loop, one optimizer step, optimizer build and resume, distribution, pre-flight checks,
and the planner that fits a whole schedule into a wall-clock budget."""
