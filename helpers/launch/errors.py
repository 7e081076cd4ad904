"""How a distributed run fails, as exceptions a caller can catch and read.

Every failure is a ``LaunchError`` carrying the ranks' stacks; a watcher (the hang doctor) adds its
``diagnosis``. ``CudaInitializedError`` is the refusal to fork (``helpers.cuda_watch``).
"""

from __future__ import annotations

from typing import Any

from helpers.cuda_watch import CudaInitializedError
from helpers.rundir import describe_exit

__all__ = ["CudaInitializedError", "LaunchError", "LaunchTimeout", "RankError", "RankExited",
           "describe_exit"]


class LaunchError(RuntimeError):
    """A distributed run did not complete; ``stacks`` maps rank -> dumped Python stacks.

    ``diagnosis`` is the hang doctor's explanation (``helpers.doctor.Diagnosis``) when it watched;
    ``results`` the ranks' return values when every rank returned (a mismatch found afterwards).
    """

    def __init__(self, message: str, stacks: dict[int, str] | None = None):
        super().__init__(message)
        self.stacks = stacks or {}
        self.diagnosis: Any = None  # helpers.doctor.Diagnosis: launch must not import the doctor
        self.results: list[Any] | None = None


class RankError(LaunchError):
    """A rank raised: names the rank, the exception type and carries its traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str):
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n\n{tb}")
        self.rank, self.exc_type, self.exc_message, self.traceback = rank, exc_type, message, tb


class RankExited(LaunchError):
    """A rank ended without returning a result (killed by a signal, os._exit, segfault)."""

    def __init__(self, rank: int, exit_code: int | None):
        super().__init__(f"rank {rank} ended without a result: {describe_exit(exit_code)}")
        self.rank, self.exit_code = rank, exit_code


class LaunchTimeout(LaunchError):
    """The run passed its deadline; every rank's stack was captured before it was stopped."""
