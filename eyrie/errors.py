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


class RegenerationError(EyrieError):
    pass


class ServerUnavailable(RegenerationError):
    """The server did not answer (refused, timed out, aborted the request): the shard fails and is retried; the
    row is never counted as dropped for it."""


class RequestRejected(RegenerationError):
    """The server answered this request with an error (after retries, for a 5xx): the row is counted by reason."""

    def __init__(self, status: int, text: str):
        super().__init__(f"vLLM answered {status}: {text[:300]}")
        self.status = status
        self.text = text
