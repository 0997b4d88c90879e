"""Lower bounds on the maximum GPU load, as kernels: the replica, pigeonhole, threshold and tier
bounds (``load_bounds``), the tier bound with the slot budget (``budget``), the head-companion
bound at a few slots a GPU (``cardinality``), the two-slot pairing and weighting bounds (``pairs``,
``pair_weights``), the hot-room condition
on a node whose heaviest expert needs most of its GPUs (``hot_room``), and the group -> node search
that proves the hierarchical bound and gives hierarchical placement its assignment (``hierarchy``).

May use it: :mod:`eplb.analysis` (the bounds and the searches they share with the methods) and the
layers above it. It imports only :mod:`eplb.kernels.plumbing`.
"""
