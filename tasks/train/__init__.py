"""Drafter training: the run every family shares (settings, data,
preparation, the loop, held-out metrics, checkpoints, distributed set-up,
serving while training, export, launch), each drafter family in a package
of its own (eagle3/, dflash/), the layers both are built from (layers/),
and the table a run picks its family from (families.py)."""
