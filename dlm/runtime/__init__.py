"""Where and how the math runs: small, stateless helpers that training, the benchmark and the evaluator share.

One module per concern, so that a device name, a precision or a peak FLOP/s figure is decided in
exactly one place: `rng` (seeding, RNG capture), `device` (device, precision, compile), `kernels`
(CUDA backends, attention kernels), `flops` (peak FLOP/s table), `memory`, `threads` (CPU threads)
and `support` (what a kind of device can run, without importing torch). Functions that touch CUDA
are guarded: on a machine without it they either do nothing (synchronize, memory) or refuse with a
`UserError` naming the config field to change. Import from the modules: nothing is re-exported here.
"""
