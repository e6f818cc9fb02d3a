"""Where and how captured states are kept: the store section of a run's
config (tasks/config.py)."""
from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from tasks.config import Section
from tasks.store.shards import BF16, StorageDtype


class StoreConfig(Section):
    """The store: its directory, how it keeps hidden states, where its index lives."""

    path: str = Field("runs/demo/store", description="store directory (created, or resumed if it exists)")
    dtype: StorageDtype = Field(BF16, description=(
        "how the store keeps hidden states: bfloat16, or float8_e4m3fn with a per-token scale (half the bytes; "
        "readers still get bf16). Part of the store's identity"))
    ledger_url: Optional[str] = Field(None, description=(
        "where a new store keeps its index: none = SQLite in the store (one machine); a postgresql:// URL, or "
        "'env' for $EAGLE3_LEDGER_URL, = PostgreSQL (many writers). Its password never travels as a parameter: "
        "give it in $EAGLE3_LEDGER_URL, PGPASSWORD or ~/.pgpass"))

    @field_validator("ledger_url")
    @classmethod
    def _no_password(cls, url: str | None) -> str | None:
        return no_password(url, "ledger_url")


def no_password(url: str | None, field: str) -> str | None:
    """`url` (an index's PostgreSQL URL), refused if it carries a password:
    Prefect keeps a run's parameters in its database and shows them in its
    UI, and a node's child run would carry them too."""
    from tasks.store.ledger.postgres import has_password

    if url and url != "env" and has_password(url):
        raise ValueError("the URL carries a password, which Prefect would keep with the run's parameters and "
                         "show in its UI: give the URL without it and the password in PGPASSWORD or "
                         f"~/.pgpass, or the whole URL in $EAGLE3_LEDGER_URL and {field}: env")
    return url
