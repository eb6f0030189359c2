"""What every runtime checks when a batch comes in: live slots of one frame size."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from inference.engine import FrameInput

T = TypeVar("T")


def batch_slots(table: Mapping[int, T], batch: list[FrameInput],
                size_of: Callable[[T], int]) -> tuple[list[T], int]:
    """The batch's slots and their common frame size; call it under the slot table's lock.

    Raises ValueError for an empty batch or mixed frame sizes, KeyError naming a slot that
    was never prepared or is released.
    """
    if not batch:
        raise ValueError("empty batch")
    try:
        slots = [table[item.slot] for item in batch]
    except KeyError as exc:
        raise KeyError(f"unknown or released portrait slot {exc.args[0]}") from None
    sizes = {size_of(slot) for slot in slots}
    if len(sizes) > 1:
        raise ValueError(f"mixed frame sizes in one batch: {sorted(sizes)}")
    return slots, sizes.pop()
