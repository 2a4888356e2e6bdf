"""Compatibility layers: other libraries' import paths over zerokit's API.

    import zerokit.compat.deepspeed as deepspeed     # see docs/deepspeed.md
"""
