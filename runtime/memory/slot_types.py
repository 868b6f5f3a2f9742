"""Value types of the expert slot pool (inference process): an expert's state, the layout of experts in a
layer's range, and the pool's entry per expert. Plain data; `runtime.memory.slots` holds the behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from runtime.device import Event
from runtime.errors import ConfigError
from runtime.nvme import align_up


class ExpertState(Enum):
    ABSENT = "absent"
    LOADING = "loading"
    RESIDENT = "resident"
    EVICTING = "evicting"


@dataclass(frozen=True)
class ExpertLayout:
    """How many experts of what size, and the slot stride the backend's granularity gives them."""

    num_layers: int
    num_experts: int
    expert_bytes: int
    granularity_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "expert_bytes", "granularity_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ExpertLayout.{name} must be > 0, got {getattr(self, name)}")

    @property
    def stride_bytes(self) -> int:
        return align_up(self.expert_bytes, self.granularity_bytes)

    @property
    def layer_bytes(self) -> int:
        return self.num_experts * self.stride_bytes


@dataclass
class _Entry:
    state: ExpertState = ExpertState.ABSENT
    slot: int | None = None
    pinned: bool = False
    load_event: Event | None = None
    readers: list[Event] | None = None
    mapped: bool = False  # the slot is mapped under the expert's range (LOADING may be reserved only)
