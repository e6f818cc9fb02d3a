"""Every flow's command line, Python API and Prefect UI form come from the
same declarations: its signature, whose sections are the stages' configs."""
import importlib

import pytest

from flows.cli import config_from_argv, help_text
from flows.config import ConfigError, is_section, parameters, parameters_model, section_fields

FLOWS = ["flows.extract:extract_hidden_states", "flows.extract_nodes:extract_across_nodes",
         "flows.verify:verify_store", "flows.train:train_drafter", "flows.evaluate:evaluate_drafter",
         "flows.regenerate:regenerate_answers", "flows.regenerate_nodes:regenerate_across_nodes",
         "flows.pipeline:eagle3_pipeline"]


def load(entry):
    module, name = entry.split(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("entry", FLOWS)
def test_help_lists_every_key_with_its_description(entry):
    flow = load(entry)
    text = help_text(flow, "prog")
    for name, (annotation, _) in parameters(flow).items():
        if is_section(annotation):
            for field, info in section_fields(annotation).items():
                key = f"--{name}.{field}".replace("_", "-")
                assert key in text, key
                assert info.description, f"{name}.{field} has no description"
        else:
            assert f"--{name.replace('_', '-')}" in text, name


@pytest.mark.parametrize("entry", FLOWS)
def test_the_ui_form_describes_every_parameter_and_every_section_field(entry):
    """Prefect builds the run form from this schema: it reads the flow's
    parameter descriptions from the docstring's Args section only (which
    `described` writes); a section's fields carry their own."""
    flow = load(entry)
    schema = flow.parameters.model_dump()
    properties, definitions = schema["properties"], schema.get("definitions", {})
    # (pydantic leaves a section's description on its definition when the two are the same)
    missing = [p for p, spec in properties.items() if not spec.get("description") and not
               definitions.get(spec.get("$ref", "").rsplit("/", 1)[-1], {}).get("description")]
    assert properties and not missing, missing
    for name, (annotation, _) in parameters(flow).items():
        if is_section(annotation):
            fields = definitions[annotation.__name__]["properties"]
            assert set(fields) == set(section_fields(annotation))
            assert all(f.get("description") for f in fields.values()), annotation.__name__


def test_the_pipeline_takes_every_stage_section():
    from flows.extract import extract_hidden_states
    from flows.pipeline import eagle3_pipeline
    from flows.evaluate import evaluate_drafter
    from flows.train import train_drafter

    pipeline = parameters(eagle3_pipeline)
    for stage in (extract_hidden_states, train_drafter, evaluate_drafter):
        for name, (annotation, _) in parameters(stage).items():
            if is_section(annotation):
                assert pipeline[name][0] is annotation, (stage.name, name)


def test_data_parallel_attention_and_many_sglang_flags_from_the_command_line():
    from flows.pipeline import eagle3_pipeline

    values, _ = config_from_argv(eagle3_pipeline, [
        "--train.lr", "3e-4", "--server.tp-size", "2", "--server.dp-size", "2", "--server.dp-attention",
        "--server.extra-args", "--enable-mixed-chunk --max-running-requests 64", "--server.dtype", "bfloat16",
        "--capture.aux-layer-ids", "2,5,6", "--store.dtype", "float8_e4m3fn"])
    server = values["server"]
    assert (server.tp_size, server.dp_size, server.dp_attention, server.dtype) == (2, 2, True, "bfloat16")
    assert server.extra_args == ["--enable-mixed-chunk", "--max-running-requests", "64"]
    assert values["train"].lr == 3e-4 and values["capture"].aux_layer_ids == [2, 5, 6]
    assert values["store"].dtype == "float8_e4m3fn"
    with pytest.raises(ConfigError, match=r"server: .*dp_size"):  # SGLang's own rule, refused before launch
        config_from_argv(eagle3_pipeline, ["--server.dp-attention"])
    with pytest.raises(ConfigError, match=r"train\.sharding: .*use one of ddp, fsdp, hsdp"):
        config_from_argv(eagle3_pipeline, ["--train.sharding", "zero"])
    with pytest.raises(ConfigError, match=r"train\.variant: .*use one of eagle3, eagle3\.1"):
        config_from_argv(eagle3_pipeline, ["--train.variant", "eagle4"])
    assert config_from_argv(eagle3_pipeline, ["--train.variant", "eagle3.1"])[0]["train"].variant == "eagle3.1"


def test_verify_takes_plain_parameters():
    from flows.verify import verify_store

    values, _ = config_from_argv(verify_store, ["--store", "s", "--no-recheck-source"])
    assert values["store"] == "s" and values["recheck_source"] is False and values["seal"] is False
    assert config_from_argv(verify_store, ["--seal"])[0]["seal"] is True


@pytest.mark.parametrize("entry", FLOWS)
def test_every_flow_has_one_model_of_its_parameters(entry):
    model = parameters_model(load(entry))
    assert set(model.model_fields) == set(parameters(load(entry)))


@pytest.mark.parametrize("argv,refused", [
    (["--capture.aux-layer-ids", "5,2,9"], r"^capture\.aux_layer_ids: .*aux layer ids \[5, 2, 9\]: not ascending"),
    (["--capture.aux-layer-ids", "2,2,9"], r"^capture\.aux_layer_ids: .*\[2\] repeated"),
    (["--train.aux-layer-ids", "1,2"], r"^train\.aux_layer_ids: .*fewer than 3"),
    (["--train.cache-epochs"], r"^train: .*train\.cache_epochs keeps what a spool's budget has room for: set "
                               r"train\.spool_bytes"),
    (["--train.stream"], r"^train\.stream: the pipeline trains while capturing with mode stream"),
    (["--train.spool-bytes", "1000000"], r"^train\.spool_bytes 1,000,000 bounds a stream run's disk"),
    (["--capture-nodes", "node-a"], r"^capture_nodes \['node-a'\]: they capture for a stream run"),
])
def test_settings_that_cannot_work_are_refused_before_anything_runs_naming_the_key(argv, refused):
    """Each was accepted by --print-config (the layer ids refused only at
    the server's launch; cache_epochs without a spool and train.stream in
    an offline run taken silently): now one line naming the key, from the
    command line, before a run starts."""
    from flows.pipeline import eagle3_pipeline

    with pytest.raises(ConfigError, match=refused) as e:
        config_from_argv(eagle3_pipeline, argv)
    assert "\n" not in str(e.value)
    # The same settings in stream mode (with a spool for cache_epochs) are a run.
    if argv[0] in ("--train.cache-epochs", "--train.stream", "--train.spool-bytes", "--capture-nodes"):
        extra = ["--train.spool-bytes", "1000000"] if argv[0] == "--train.cache-epochs" else []
        assert config_from_argv(eagle3_pipeline, [*argv, *extra, "--mode", "stream"])[0]["mode"] == "stream"
