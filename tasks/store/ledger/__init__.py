"""The ledger: the store's index, and the single source of truth for
progress, resume and verification. index.py is the interface, sqlite.py and
postgres.py the backends, open.py picks a store's backend and opens it."""
