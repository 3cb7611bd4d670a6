"""The network: the diffusion transformer, its attention, and the Denoiser contract."""
