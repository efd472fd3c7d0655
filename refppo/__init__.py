"""refppo: a verified reference implementation of PPO for LLM RLHF."""

__version__ = "0.1.0"
