"""Embedded tasks: everything a demo or test run needs is built in code — nothing is downloaded."""

from __future__ import annotations

from refppo.tasks.words import WordsTask, build_tokenizer, rule_reward

__all__ = ["WordsTask", "build_tokenizer", "rule_reward"]
