"""Log a message once per process: backend choices and fallbacks are decided on every call,
but a user needs to read each decision once."""
from __future__ import annotations

import logging

__all__ = ["log_once"]

_LOGGED: set = set()  # (logger name, message) pairs already logged


def log_once(logger: logging.Logger, level: int, msg: str) -> None:
    """``logger.log(level, msg)`` the first time this logger sees ``msg`` in this process."""
    key = (logger.name, msg)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg)
