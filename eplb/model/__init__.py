"""The deployment model: input checks, the topology, the deployment, the cost model
(lowest layer: imports nothing else of the package)."""
