"""Graph passes: joint fx graph -> planning Problem, and Plan -> forward/backward modules."""

from .extract import Extracted, extract
from .rewrite import ScheduleMismatch, rewrite

__all__ = ["Extracted", "ScheduleMismatch", "extract", "rewrite"]
