"""Where the physical slots live: slots -> GPUs -> nodes.

GPU ``g`` holds the contiguous block of slots ``slot_offsets[g] : slot_offsets[g + 1]``; GPUs
``n * G/N ... (n + 1) * G/N - 1`` form node ``n``. The usual layout gives every GPU the same
number of slots ``k = S / G``; engines also run layouts where some GPUs hold one slot more or a
drained GPU holds none, so the slot count per GPU is an array.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ._validation import as_int
from .sizes import check_limit


class OnTopology:
    """The sizes of a value laid out on a :class:`Topology` (its ``topology`` attribute): a
    :class:`~eplb.model.deployment.Deployment` and a :class:`~eplb.Placement` read them the same way."""

    @property
    def num_slots(self) -> int:
        return self.topology.num_slots

    @property
    def num_gpus(self) -> int:
        return self.topology.num_gpus

    @property
    def num_nodes(self) -> int:
        return self.topology.num_nodes


@dataclass(frozen=True, eq=False)
class Topology:
    """Slots per GPU and GPUs per node of an expert-parallel deployment.

    Attributes:
        slots_per_gpu: ``[G]`` int64, number of physical expert slots on each GPU (0 = masked GPU).
        num_nodes: ``N``, number of nodes; ``G`` must be a multiple of ``N``.
    """

    slots_per_gpu: np.ndarray
    num_nodes: int = 1
    slot_offsets: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        slots = np.asarray(self.slots_per_gpu)
        if slots.ndim != 1 or slots.size == 0:
            raise ValueError(f"slots_per_gpu must be a non-empty 1-d array, got shape {slots.shape}")
        if not np.issubdtype(slots.dtype, np.integer):
            raise ValueError(f"slots_per_gpu must hold integers, got dtype {slots.dtype}")
        if (slots < 0).any():
            raise ValueError("slots_per_gpu must be non-negative")
        check_limit(slots.size, "gpus", "the number of GPUs")  # before any [S] array is built
        check_limit(slots.max(), "slots", "the slots of one GPU")
        check_limit(slots.astype(np.int64).sum(), "slots", "the number of slots")
        if slots.sum() < 1:
            raise ValueError("slots_per_gpu must give at least one slot in total")
        num_nodes = as_int(self.num_nodes, "num_nodes", minimum=1)
        if slots.size % num_nodes:
            raise ValueError(f"num_gpus ({slots.size}) must be divisible by num_nodes ({num_nodes})")
        slots = slots.astype(np.int64)
        slots.setflags(write=False)
        offsets = np.zeros(slots.size + 1, np.int64)
        np.cumsum(slots, out=offsets[1:])
        offsets.setflags(write=False)
        object.__setattr__(self, "slots_per_gpu", slots)
        object.__setattr__(self, "num_nodes", num_nodes)
        object.__setattr__(self, "slot_offsets", offsets)

    @classmethod
    def uniform(cls, num_slots, num_gpus, num_nodes=1) -> "Topology":
        """``num_slots`` spread evenly, ``num_slots / num_gpus`` per GPU (must divide)."""
        num_slots = as_int(num_slots, "num_slots", minimum=1)
        num_gpus = as_int(num_gpus, "num_gpus", minimum=1)
        num_nodes = as_int(num_nodes, "num_nodes", minimum=1)
        check_limit(num_gpus, "gpus", "num_gpus")
        check_limit(num_slots, "slots", "num_slots")
        if num_slots % num_gpus:
            raise ValueError(f"num_slots ({num_slots}) must be divisible by num_gpus ({num_gpus})")
        if num_gpus % num_nodes:
            raise ValueError(f"num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes})")
        return cls(np.full(num_gpus, num_slots // num_gpus, np.int64), num_nodes)

    @classmethod
    def from_layout(cls, num_slots, num_gpus, num_nodes=1, masked_gpus=()) -> "Topology":
        """``num_slots`` spread as evenly as possible over the GPUs not in ``masked_gpus``.

        When the slots do not divide evenly, the first ``num_slots % active`` active GPUs hold one
        slot more; a masked GPU (failed or drained rank) holds none.

        Args:
            num_slots: ``S >= 1``; num_gpus: ``G``, a multiple of ``num_nodes``.
            masked_gpus: GPU indices in ``[0, G)`` that get no slots (at least one GPU must stay).
        """
        num_slots = as_int(num_slots, "num_slots", minimum=1)
        num_gpus = as_int(num_gpus, "num_gpus", minimum=1)
        num_nodes = as_int(num_nodes, "num_nodes", minimum=1)
        check_limit(num_gpus, "gpus", "num_gpus")
        check_limit(num_slots, "slots", "num_slots")
        if num_gpus % num_nodes:
            raise ValueError(f"num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes})")
        listed = [as_int(g, "masked_gpus entry") for g in masked_gpus]
        masked = sorted(set(listed))
        if len(masked) != len(listed):  # as DeploymentChange.lose and the simulator refuse them (issue 47 item 17)
            raise ValueError(f"masked_gpus names a GPU twice: {listed}")
        if masked and (masked[0] < 0 or masked[-1] >= num_gpus):
            raise ValueError(f"masked_gpus must hold GPU indices in [0, {num_gpus}), got {masked}")
        active = np.setdiff1d(np.arange(num_gpus), masked)
        if active.size == 0:
            raise ValueError("masked_gpus must leave at least one GPU with slots")
        base, extra = divmod(num_slots, active.size)
        slots = np.zeros(num_gpus, np.int64)
        slots[active] = base
        slots[active[:extra]] += 1
        return cls(slots, num_nodes)

    @property
    def num_slots(self) -> int:
        return int(self.slot_offsets[-1])

    @property
    def num_gpus(self) -> int:
        return int(self.slots_per_gpu.size)

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes

    @property
    def is_uniform(self) -> bool:
        """True when every GPU holds the same number of slots."""
        return bool((self.slots_per_gpu == self.slots_per_gpu[0]).all())

    @property
    def gpu_of_slot(self) -> np.ndarray:
        """``[S]`` int64: the GPU holding each slot."""
        return np.repeat(np.arange(self.num_gpus, dtype=np.int64), self.slots_per_gpu)

    @property
    def node_of_gpu(self) -> np.ndarray:
        """``[G]`` int64: the node of each GPU."""
        return np.arange(self.num_gpus, dtype=np.int64) // self.gpus_per_node

    @property
    def slots_per_node(self) -> np.ndarray:
        """``[N]`` int64: slots on each node."""
        return self.slots_per_gpu.reshape(self.num_nodes, -1).sum(axis=1)

    def to_dict(self) -> dict:
        return {"slots_per_gpu": self.slots_per_gpu.tolist(), "num_nodes": self.num_nodes}

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        """The topology :meth:`to_dict` wrote: ``{"slots_per_gpu": [G] ints, "num_nodes": N}``."""
        if not isinstance(data, dict) or "slots_per_gpu" not in data:
            raise ValueError(f"topology must be a dict with slots_per_gpu (and num_nodes), got {data!r:.80}")
        slots = np.asarray(data["slots_per_gpu"])
        if slots.ndim != 1 or slots.dtype == object or slots.dtype.kind not in "iu":
            raise ValueError(f"topology slots_per_gpu must be a list of integers, got {data['slots_per_gpu']!r:.80}")
        return cls(slots.astype(np.int64), data.get("num_nodes", 1))

    def __eq__(self, other):
        return (
            isinstance(other, Topology)
            and self.num_nodes == other.num_nodes
            and np.array_equal(self.slots_per_gpu, other.slots_per_gpu)
        )

    def __hash__(self):
        return hash((self.num_nodes, self.slots_per_gpu.tobytes()))
