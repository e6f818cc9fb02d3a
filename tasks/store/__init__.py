"""The store: the on-disk data contract (manifest, ledger, shards), its
reader, and its verification."""
