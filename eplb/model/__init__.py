"""The deployment model: input checks, the topology, the problem configuration, the cost model
(lowest layer: imports nothing else of the package)."""
