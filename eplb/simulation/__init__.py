"""Simulation: replaying series through a deployment and a policy, sweeps, synthetic counts and
series generators."""
