"""Numbers about loads and placements: the ``Placement`` result type, metrics, lower bounds, the
searches the bounds share with the methods, dispatch (how tokens split among replicas) and the
windows of a series."""
