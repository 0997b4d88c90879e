"""Numbers about loads and placements: the ``Placement`` result type, loads (the one load function:
per slot under any split, then per GPU and node), metrics, lower bounds, the searches the bounds
share with the methods, dispatch (how tokens split among replicas) and the windows of a series."""
