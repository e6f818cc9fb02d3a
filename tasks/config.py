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

from typing import Annotated, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict

from tasks.target.layers import AuxLayers


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    def model_copy(self, *, update: dict | None = None, deep: bool = False):
        if not update:
            return super().model_copy(deep=deep)
        return type(self).model_validate({**self.model_dump(), **update})


def _checked_ids(ids: list[int] | None) -> list[int] | None:
    return None if ids is None else list(AuxLayers(tuple(ids)).sglang_ids)


# A setting's aux layer ids (SGLang's convention), checked for their count,
# order and repeats when given; their range once the target is loaded
# (AuxLayers.for_model), whether a store holds them when it is opened.
# Here, not in tasks/target/layers.py, which the capture hook and the GPU
# bench import without pydantic.
AuxLayerIds = Annotated[Optional[list[int]], AfterValidator(_checked_ids)]
