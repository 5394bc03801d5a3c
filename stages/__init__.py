"""One thin module per DVC stage: ``python -m stages.<name>``."""
