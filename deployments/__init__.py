"""Eyrie's Prefect deployments: prefect.yaml (the deployments) and setup.py (everything else on the server)."""
