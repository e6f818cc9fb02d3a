"""Regeneration: every answer of a dataset written again by the target, in
batches, resumable, into answer shards with an index (the capture then
reads them as its dataset). config.py: the regenerate section; turns.py:
what the target is asked, turn by turn; answers.py: asking it; answer_store.py:
the shards, their index and provenance; stage.py: plan and batch."""
