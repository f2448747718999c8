"""Errors that reach the user. Each says what is wrong and how to fix it."""


class EyrieError(Exception):
    """A problem the user can fix; the message says how."""


class ConfigError(EyrieError):
    pass


class DataError(EyrieError):
    pass


class PreflightError(EyrieError):
    """One or more checks failed before any weights were loaded."""

    def __init__(self, failures: list[str]):
        self.failures = failures
        lines = "\n".join(f"  - {f}" for f in failures)
        super().__init__(f"preflight failed ({len(failures)} problem(s)), no weights were loaded:\n{lines}")


class ExtractionError(EyrieError):
    pass


class DiskFullError(ExtractionError):
    """Out of disk space: retrying cannot help until someone frees space."""


class RunFolderError(EyrieError):
    pass
