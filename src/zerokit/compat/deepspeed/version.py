"""The DeepSpeed API version this layer mirrors; the compatibility distribution carries it as its
own version with a `+zerokit` local label (compat/deepspeed/pyproject.toml must match)."""
DEEPSPEED_API_VERSION = "0.19.8"
__version__ = f"{DEEPSPEED_API_VERSION}+zerokit"
