"""The "zerokit" logger: what rank 0 shows by default, and how a user turns it down or takes it over.

zerokit reports through one logger: the start-up plan and the config keys it ignores
(config/plan.py), the steps_per_print lines (Engine._report_progress), checkpoint messages. A
logger nobody configured shows only warnings, so `initialize` calls `configure_logging`:
- on rank 0, unless the user configured logging already (the root logger has handlers or a level
  other than the default, or the "zerokit" logger has handlers or a level), it adds one handler
  writing the bare message to stderr and sets the "zerokit" logger to INFO, as DeepSpeed prints
  its own lines on rank 0. The handler stays silent once the root logger has handlers, so
  configuring logging after `initialize` does not print every line twice;
- other ranks get no handler: their warnings still reach stderr through Python's last resort;
- ZEROKIT_LOG=debug|info|warning|error|critical sets the "zerokit" logger's level on every rank,
  whoever configured the handlers (ZEROKIT_LOG=warning hides the plan and the progress lines).
"""
from __future__ import annotations

import logging
import os

LOGGER = "zerokit"
ENV = "ZEROKIT_LOG"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}

log = logging.getLogger(LOGGER)


def env_level() -> int | None:
    """The level ZEROKIT_LOG asks for, or None if it is unset."""
    value = os.environ.get(ENV)
    if value is None or value.strip() == "":
        return None
    level = LEVELS.get(value.strip().lower())
    if level is None:
        raise ValueError(f"{ENV}={value!r} is not a log level; allowed: {', '.join(LEVELS)}")
    return level


def default_handler(logger: logging.Logger = log) -> logging.Handler | None:
    """The handler configure_logging added to `logger`, if any."""
    return next((h for h in logger.handlers if getattr(h, "_zerokit_default", False)), None)


def _user_configured(logger: logging.Logger) -> bool:
    root = logging.getLogger()
    return bool(root.handlers) or root.level != logging.WARNING or bool(logger.handlers) \
        or logger.level != logging.NOTSET


def _root_has_no_handlers(_record: logging.LogRecord) -> bool:
    return not logging.getLogger().handlers


def configure_logging(rank: int) -> None:
    """Make rank 0's INFO lines visible unless the user configured logging; apply ZEROKIT_LOG.
    Idempotent: a second initialize in the same process adds nothing."""
    level = env_level()
    install = rank == 0 and default_handler() is None and not _user_configured(log)
    if install:
        handler = logging.StreamHandler()  # sys.stderr as it is now
        handler._zerokit_default = True
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(_root_has_no_handlers)
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    if level is not None:
        log.setLevel(level)
