"""epo: train LLM agents with RL on long, multi-turn, sparse-reward tasks (EPO, PPO, GRPO)."""

__version__ = "0.1.0"
