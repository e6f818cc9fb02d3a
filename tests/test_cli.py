import inspect

import pytest

from flows.cli import build_parser
from flows.extract import extract_hidden_states
from flows.verify import verify_store


def test_cli_mirrors_the_flow_signature_with_descriptions():
    parser = build_parser(extract_hidden_states, "python -m flows.extract")
    text = parser.format_help()
    for name in inspect.signature(extract_hidden_states.fn).parameters:
        assert f"--{name.replace('_', '-')}" in text
    assert "samples per batch task and per shard" in text and "{truncate,skip}" in text
    args = parser.parse_args(["--batch-size", "7", "--aux-layer-ids", "1", "3", "4", "--no-verify",
                              "--max-length-policy", "skip"])
    assert args.batch_size == 7 and args.aux_layer_ids == [1, 3, 4] and args.verify is False
    assert args.max_length_policy == "skip" and args.server_url is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-length-policy", "drop"])


def test_verify_cli():
    args = build_parser(verify_store, "python -m flows.verify").parse_args(["--store", "s", "--no-recheck-source"])
    assert args.store == "s" and args.recheck_source is False and args.seal is False
    assert build_parser(verify_store, "python -m flows.verify").parse_args(["--seal"]).seal is True


@pytest.mark.parametrize("entry", ["flows.extract:extract_hidden_states", "flows.verify:verify_store",
                                   "flows.train:train_drafter", "flows.serve:serve_check",
                                   "flows.pipeline:eagle3_pipeline"])
def test_the_ui_form_describes_every_parameter(entry):
    """Prefect builds the run form from this schema; it reads descriptions
    from the docstring's Args section only, which `described` writes."""
    import importlib

    module, name = entry.split(":")
    flow = getattr(importlib.import_module(module), name)
    properties = flow.parameters.model_dump()["properties"]
    missing = [p for p, spec in properties.items() if not spec.get("description")]
    assert properties and not missing, missing
