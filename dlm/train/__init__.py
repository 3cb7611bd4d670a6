"""Training: the loop, one optimizer step, optimizer build and resume, distribution, pre-flight checks."""
