"""The searches over placements: how many replicas each expert gets (``replication``), packing
replicas onto GPUs and its working state (``packing``), the default placement (``pack_descend``),
swap descents (``local_search``), the ``best`` method's search over replications (``multistart``),
the exact branch and bound of tiny instances (``tiny``), the packing under a load cap behind the
certificates (``capped``), few changes from a placement in service (``few_changes``, ``relabel``, ``tiny_changes``), rings of
replicas for optimal dispatch (``linked``) and the node-level step of locality (``off_node``).

May use it: :mod:`eplb.kernels.change` (which packs a layer while spreading it), and the layers
above the kernels. It imports only :mod:`eplb.kernels.plumbing`.
"""
