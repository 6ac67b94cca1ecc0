"""Library logging: one ``torch.sagemaker`` logger with the rank in every line."""

from __future__ import annotations

import logging
import os

_LOGGER_NAME = "torch.sagemaker"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        import torch.distributed as dist

        record.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else "-"
        return True


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _level_from_env() -> str:
    """``TSM_LOG_LEVEL`` (default INFO); an unknown name raises naming the accepted ones."""
    level = os.environ.get("TSM_LOG_LEVEL", "INFO").strip().upper() or "INFO"  # noqa: TID251
    if level not in _LEVELS:
        raise ValueError(
            f"TSM_LOG_LEVEL={level[:40]!r}: the log level must be one of "
            f"{', '.join(_LEVELS)}; set one of them or unset the variable."
        )
    return level


def get_logger() -> logging.Logger:
    """Returns the library logger (``[tsm rank N] LEVEL message``), configured once.

    The level defaults to INFO and follows ``TSM_LOG_LEVEL`` when set.
    """
    logger = logging.getLogger(_LOGGER_NAME)
    if not getattr(logger, "_tsm_configured", False):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[tsm rank %(rank)s] %(levelname)s %(message)s"))
        handler.addFilter(_RankFilter())
        logger.addHandler(handler)
        logger.setLevel(_level_from_env())
        logger.propagate = False
        logger._tsm_configured = True  # type: ignore[attr-defined]
    return logger


def log_rank0(message: str, level: int = logging.INFO) -> None:
    """Logs ``message`` on global rank 0 only (or when no process group exists)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        get_logger().log(level, message)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Logs a warning on rank 0 the first time ``message`` is seen in this process."""
    if message not in _warned:
        _warned.add(message)
        log_rank0(message, logging.WARNING)
