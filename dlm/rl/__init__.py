"""`dlm rl`: reinforcement learning with verifiable rewards (GRPO-family) on top of training's loop."""
