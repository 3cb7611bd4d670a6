"""dlm bench: training throughput, batch finder, generation benchmark, their results."""
