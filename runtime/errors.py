"""Errors raised by the runtime (inference process).

Every refusal names what was wrong, where, and what was expected, and is raised before any state changes.
"""


class RuntimeTierError(Exception):
    """Base class of every error the runtime raises on purpose."""


class ConfigError(RuntimeTierError, ValueError):
    """A constructor argument or layout is invalid."""


class UnknownBlockError(RuntimeTierError, KeyError):
    """A KV block id is not allocated."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown block"


class DoubleFreeError(RuntimeTierError):
    """A KV block or slot was freed twice."""


class CapacityError(RuntimeTierError):
    """A tier or pool has no room for the request."""


class AlignmentError(RuntimeTierError, ValueError):
    """An offset, length or buffer address violates the required alignment."""


class CorruptDataError(RuntimeTierError):
    """Bytes read back do not match the checksum recorded when they were written."""


class BusyError(RuntimeTierError):
    """The object is in flight or still read by someone (refcount, pending move, reader events)."""


class NotResidentError(RuntimeTierError):
    """An expert was accessed while it is not resident in a slot (or still loading)."""


class PinnedError(RuntimeTierError):
    """A pinned expert cannot be unmapped."""


class TransferError(RuntimeTierError):
    """A transfer failed; the original exception is chained."""


class CudaError(RuntimeTierError):
    """A CUDA driver call returned something other than CUDA_SUCCESS."""
