"""What runs leave on disk and how it is read back: checkpoints, run directories, events, exports."""
