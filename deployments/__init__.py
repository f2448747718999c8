"""Eyrie's Prefect deployments: prefect.yaml (the GPU nodes, listed once, and the deployments) and setup.py (makes a
Prefect server match it: pools, a queue per node, the zombie automation, the deployments)."""
