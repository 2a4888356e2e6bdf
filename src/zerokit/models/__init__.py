"""Small models shipped with zerokit for the demo, tests and benchmarks."""
from zerokit.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
