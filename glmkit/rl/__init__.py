"""RL: data, rewards, GRPO, LoRA, the training loop and its health check."""
