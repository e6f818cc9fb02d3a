"""The drafter families, and the one place a run picks one (train.method):
each row is what the shared training run (prepare, loop, held-out
metrics, served) asks of a family. A fourth family is a package beside
eagle3/ and dflash/ whose training.py gives each of these, and a row here
(and its name among train.method's choices, tasks/train/config.py). What a
row holds: Family, in tasks/train/run.py beside the Run its functions take."""
from __future__ import annotations

from pathlib import Path

from tasks.train.config import TrainConfig
from tasks.train.dflash import training as dflash
from tasks.train.eagle3 import training as eagle3
from tasks.train.run import Family

FAMILIES = {
    "eagle3": Family.of("eagle3", "EAGLE-3", eagle3),  # one layer unrolled step by step (TTT), a chain served
    "dflash": Family.of("dflash", "DFlash", dflash),  # block diffusion, a block served
}


def family_of(cfg: TrainConfig) -> Family:
    return FAMILIES[cfg.method]


def exported_family(config: dict, where: str | Path = "the drafter") -> Family:
    """The family of an exported drafter, from its config.json; ValueError
    naming `where` for one no family exports."""
    for family in FAMILIES.values():
        if family.is_export(config):
            return family
    raise ValueError(f"{where}/config.json (architectures {config.get('architectures')}) is no drafter of "
                     f"{', '.join(f.label for f in FAMILIES.values())}")

