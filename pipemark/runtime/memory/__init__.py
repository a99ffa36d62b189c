"""What a plan holds on each device: its programs compiled, with XLA's memory
analysis of each (``programs``), each slot's peak predicted (``estimate``), and
a plan chosen within a memory budget (``budget``).

The package hands on the names of ``estimate``, which was the module
``pipemark.runtime.memory``: ``from pipemark.runtime.memory import MemoryEstimate``
reads as it did.
"""

from pipemark.runtime.memory.estimate import MemoryEstimate as MemoryEstimate
from pipemark.runtime.memory.estimate import SlotMemory as SlotMemory
from pipemark.runtime.memory.estimate import argument_bytes as argument_bytes
from pipemark.runtime.memory.estimate import describe_limit as describe_limit
from pipemark.runtime.memory.estimate import device_bytes as device_bytes
from pipemark.runtime.memory.estimate import device_padding as device_padding
from pipemark.runtime.memory.estimate import estimate_memory as estimate_memory
from pipemark.runtime.memory.estimate import format_bytes as format_bytes
from pipemark.runtime.memory.estimate import held_in_flight as held_in_flight
from pipemark.runtime.memory.estimate import held_while_running as held_while_running
from pipemark.runtime.memory.estimate import local_device as local_device
from pipemark.runtime.memory.estimate import plan_memory as plan_memory
from pipemark.runtime.memory.estimate import resident_bytes as resident_bytes
from pipemark.runtime.memory.estimate import result_avals as result_avals
from pipemark.runtime.memory.estimate import with_host as with_host
from pipemark.runtime.memory.estimate import with_update as with_update

__all__ = [
    "MemoryEstimate",
    "SlotMemory",
    "argument_bytes",
    "describe_limit",
    "device_bytes",
    "device_padding",
    "estimate_memory",
    "held_in_flight",
    "held_while_running",
    "format_bytes",
    "local_device",
    "plan_memory",
    "resident_bytes",
    "result_avals",
    "with_host",
    "with_update",
]
