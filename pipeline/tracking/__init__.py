"""Experiment tracking: MLflow runs (rank 0 only, outage-safe) and lineage from git and DVC."""
