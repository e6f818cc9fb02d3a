"""Whether and how a dataset's answers are rewritten by the target first:
the regenerate section of a pipeline's config (tasks/config.py)."""
from __future__ import annotations

from pydantic import Field

from tasks.config import Section


class RegenerateConfig(Section):
    """Replace every answer with the target's own (greedy) before capture: drafters learn best from the
    target's outputs."""

    enabled: bool = Field(False, description="regenerate the answers, on a plain SGLang server of the target, "
                                             "before capture (reused while source, model and settings match)")
    max_new_tokens: int = Field(256, ge=1, description="longest regenerated answer, in tokens")
