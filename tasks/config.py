"""What every stage's settings are: a `Section`, a pydantic model whose
fields are declared once, each with its type, default, limits and
description. The flows take sections as their parameters, so the Python API,
the command line (flows/cli.py: a YAML or JSON run file, then dotted
overrides such as `--train.lr 3e-4`) and the Prefect UI's run form (one
group per section) are all made from these declarations.

A section refuses keys it does not declare (a typo is an error, never a
setting silently ignored) and is frozen: a changed copy is
`section.model_copy(update=...)`, so a default instance can be shared as
a flow parameter's default. Unlike pydantic's own, this `model_copy`
validates the copy: a changed setting is checked like a given one."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    def model_copy(self, *, update: dict | None = None, deep: bool = False):
        if not update:
            return super().model_copy(deep=deep)
        return type(self).model_validate({**self.model_dump(), **update})
