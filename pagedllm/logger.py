"""The "pagedllm" logger: INFO lines on stderr unless the application set logging up itself, as
vLLM does; PAGEDLLM_LOGGING_LEVEL (or vLLM's VLLM_LOGGING_LEVEL) sets the level."""
from __future__ import annotations

import logging
import os
from typing import Optional

LOGGER_NAME = "pagedllm"
LOG_FORMAT = "%(levelname)s %(asctime)s %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
LEVEL_ENV_VARS = ("PAGEDLLM_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL")


def env_level() -> Optional[int]:
    """The level the first set of LEVEL_ENV_VARS names, or None; ValueError naming the variable
    for a name that is not a level."""
    for var in LEVEL_ENV_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            level = logging.getLevelName(value.upper())
            if not isinstance(level, int):
                raise ValueError(f"{var}={value!r} is not a logging level; use DEBUG, INFO, "
                                 "WARNING or ERROR")
            return level
    return None


def configure_logging(default_level: int = logging.INFO) -> None:
    """Give the "pagedllm" logger a stderr handler when neither it nor the root logger has one
    (nobody configured logging), at the environment's level, else default_level. Where the
    application configured logging, only the environment's level is applied."""
    logger = logging.getLogger(LOGGER_NAME)
    ours = not logger.handlers and not logging.getLogger().handlers
    if ours:
        handler = logging.StreamHandler()  # sys.stderr
        handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
    level = env_level()
    if ours or level is not None:
        logger.setLevel(level if level is not None else default_level)
