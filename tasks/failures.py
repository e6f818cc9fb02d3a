"""Failures a retry cannot mend: the same run fails the same way again
(data found corrupt, a lock another run holds, settings that differ from
the store's or the checkpoint's, a store not verified). Their classes
derive from `Permanent`, and the flows' task retries skip them
(flows/retries.py), so such a run fails at once with its reason instead
of after every retry and its delay."""
from __future__ import annotations


class Permanent(Exception):
    """Mixed into an error class whose cause a retry cannot remove."""


class EndsRun(Permanent):
    """A failure no other batch of the run can escape either (its server is
    gone for good): the flow stops at the first, not after every batch has
    failed the same way with its retries (flows/batches.py drain)."""
