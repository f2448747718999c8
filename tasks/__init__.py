"""Prefect tasks: one module per stage, each a thin wrapper around an eyrie library call
(cache policy, retries, names, artifacts). No pipeline logic lives here."""
