"""Serving: the online balancer, the policy seam (``Policy``, the provided policies and their one
registry of names), transfer plans, engine adapters."""
