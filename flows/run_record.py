"""Each run's resolved config, kept beside what it wrote and shown in the
UI: the settings a store or a drafter came from can always be read back,
and rerun with `--config` (secrets blanked: flows/config.py as_record)."""
from __future__ import annotations

import time
from pathlib import Path

from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from flows.artifacts import artifact_key
from flows.config import to_yaml
from tasks.durable import replace_durably


def keep_run_config(path: Path, flow: str, describes: str | Path) -> Path:
    """The running flow's parameters, as YAML, at `path` (a directory: a new
    `<UTC time>-<flow>-config.yaml` in it; a .yaml file: replaced), and as a
    markdown artifact keyed by what the run writes (`describes`)."""
    text = to_yaml(flow_run.parameters)
    path = Path(path)
    if path.suffix != ".yaml":
        path = path / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{flow}-config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_durably(path, lambda tmp: tmp.write_text(f"# {flow}, resolved config of flow run {flow_run.get_id()}\n"
                                                     + text))
    create_markdown_artifact(markdown=f"### Run config\n\n`{path}`\n\n```yaml\n{text}```\n",
                             key=artifact_key(f"run-config-{flow.replace('_', '-')}", describes),
                             description=f"resolved config of this {flow} run")
    return path


def kept(values: dict) -> str:
    """What a stopped command-line run leaves for its rerun, from its
    parameters (flows/cli.py says it)."""
    parts = []
    if (store := values.get("store")) is not None and getattr(store, "path", None):
        parts.append(f"{_stored(store.path)} in {Path(store.path).resolve()} kept")
    if (train := values.get("train")) is not None and getattr(train, "out_dir", None):
        parts.append(f"training checkpoints in {Path(train.out_dir).resolve()} kept")
    return "; ".join(parts)


def _stored(path: str) -> str:
    from tasks.store.handle import Store

    try:
        summary = Store.open(path).ledger.summary()
    except Exception:  # no store yet, or its index unreachable: say what is certain
        return "the samples committed"
    return f"{summary['samples']:,} samples ({summary['tokens']:,} tokens)"
