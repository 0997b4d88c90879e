"""Serving: the online balancer, transfer plans, engine adapters."""
