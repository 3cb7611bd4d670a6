"""dlm's measuring kit: `python -m benchmarks NAME` from a clone of the repository.

Each benchmark measures one claim against a baseline in the same run (`dlm.bench.measure`: interleaved
rounds, CPU and wall seconds, a machine stamp) and writes benchmarks/results/NAME.json;
docs/benchmarks.md is rendered from those files (`python -m benchmarks render-docs`).
"""
