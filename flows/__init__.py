"""Prefect flows: the DAGs. They wire tasks/ together and hold no pipeline logic of their own."""
