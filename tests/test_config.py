"""The run-config machinery (flows/config.py, flows/cli.py) on a flow-shaped
function: one order of precedence, one grammar for overrides, and every bad
key, type or value refused naming the key."""
from __future__ import annotations

from typing import Annotated, Literal, Optional

import pytest
import yaml
from pydantic import Field

from flows.cli import help_text, parse
from flows.config import described
from flows.config import ConfigError, resolve, to_yaml
from flows.cli import config_from_argv
from tasks.config import Section
from tasks.store.config import StoreConfig


class Knobs(Section):
    """Knobs of a stage."""

    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    steps: int = Field(7, ge=1, description="unroll depth")
    mode: Literal["ddp", "fsdp"] = Field("ddp", description="how to shard")
    layers: Optional[list[int]] = Field(None, description="layer ids")
    extra_args: list[str] = Field([], description="more flags")
    on: bool = Field(False, description="a switch")
    api_key: Optional[str] = Field(None, description="a secret")


@described
def a_flow(knobs: Knobs = Knobs(), verify: Annotated[bool, Field(description="check at the end")] = True,
           name: Annotated[str, Field(description="a name")] = "x"):
    """A flow-shaped function."""


def test_defaults_then_file_then_overrides(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("knobs: {lr: 1.0e-3, steps: 3, layers: [2, 5, 6]}\nname: from-file\n")
    values, printed = config_from_argv(a_flow, ["--config", str(run), "--knobs.steps", "5", "--no-verify"])
    assert not printed
    assert values["knobs"] == Knobs(lr=1e-3, steps=5, layers=[2, 5, 6])  # the file, then the override
    assert values["verify"] is False and values["name"] == "from-file"
    assert config_from_argv(a_flow, [])[0] == {"knobs": Knobs(), "verify": True, "name": "x"}


def test_every_key_takes_one_value_whatever_it_looks_like():
    _, overrides, _ = parse(a_flow, [
        "--knobs.extra-args", "--dp-size 2 --enable-dp-attention",  # a value that starts with --
        "--knobs.extra-args", "--enable-mixed-chunk",  # given twice: added
        "--knobs.layers", "1,3,4", "--knobs.on", "--knobs.lr=5e-4", "--print-config"])
    assert overrides == {"knobs": {"extra_args": ["--dp-size", "2", "--enable-dp-attention",
                                                  "--enable-mixed-chunk"],
                                   "layers": ["1", "3", "4"], "on": True, "lr": "5e-4"}}
    values = resolve(a_flow, overrides)
    assert values["knobs"].layers == [1, 3, 4] and values["knobs"].lr == 5e-4
    assert parse(a_flow, ["--knobs.layers", "[2, 5, 6]", "--knobs.on", "false"])[1] == {
        "knobs": {"layers": [2, 5, 6], "on": "false"}}
    assert resolve(a_flow, parse(a_flow, ["--knobs.layers", "none"])[1])["knobs"].layers is None
    assert resolve(a_flow, parse(a_flow, ["--knobs.api-key", "none"])[1])["knobs"].api_key is None  # optional text
    assert resolve(a_flow, parse(a_flow, ["--name", "none"])[1])["name"] == "none"  # plain text stays text
    # A list takes the words after its value, up to the next --key.
    assert parse(a_flow, ["--knobs.layers", "2", "5", "6", "--knobs.extra-args", "--max-running-requests", "64",
                          "--no-verify"])[1] == {"knobs": {"layers": ["2", "5", "6"],
                                                           "extra_args": ["--max-running-requests", "64"]},
                                                 "verify": False}


def test_a_changed_copy_of_a_section_is_checked_like_a_given_one():
    with pytest.raises(ValueError, match="greater than 0"):
        Knobs().model_copy(update={"lr": -1.0})
    assert Knobs().model_copy(update={"steps": 3}) == Knobs(steps=3)


@pytest.mark.parametrize("argv, message", [
    (["--knobs.lrr", "1"], r"--knobs\.lrr: unknown key \(did you mean --knobs\.lr\?\)"),
    (["--knobz.lr", "1"], r"--knobz\.lr: unknown key"),
    (["--knobs.lr", "-1"], r"knobs\.lr: Input should be greater than 0 \(given: '-1'\)"),
    (["--knobs.steps", "two"], r"knobs\.steps: Input should be a valid integer"),
    (["--knobs.mode", "zero"], r"knobs\.mode: Input should be 'ddp' or 'fsdp' \(given: 'zero'\)"),
    (["--knobs.steps"], r"--knobs\.steps needs a value"),
    (["stray"], r"'stray': expected --KEY VALUE"),
])
def test_bad_overrides_are_refused_naming_the_key(argv, message):
    with pytest.raises(ConfigError, match=message):
        config_from_argv(a_flow, argv)


def test_bad_files_are_refused_naming_the_key(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("knobs: {lr: 1.0e-3, stepz: 3}\nbogus: 1\n")
    with pytest.raises(ConfigError) as e:
        config_from_argv(a_flow, ["--config", str(run)])
    assert "knobs.stepz: unknown key (did you mean 'steps'?); knobs takes: lr, steps, mode" in str(e.value)
    assert "bogus: unknown key; the parameters are: knobs, verify, name" in str(e.value)
    run.write_text("- a list\n")
    with pytest.raises(ConfigError, match="holds a list, not a mapping"):
        config_from_argv(a_flow, ["--config", str(run)])
    with pytest.raises(ConfigError, match="no-such.yaml"):
        config_from_argv(a_flow, ["--config", str(tmp_path / "no-such.yaml")])


def test_help_lists_every_key_with_its_default_and_description():
    text = help_text(a_flow, "prog")
    for key, default in (("--knobs.lr FLOAT", "0.0003"), ("--knobs.mode {ddp,fsdp}", "'ddp'"),
                         ("--knobs.extra-args LIST[STR]", "[]"), ("--verify BOOL", "True")):
        assert key in text, key
        assert f"(default: {default})" in text.split(key, 1)[1].split("\n  --", 1)[0], key
    assert "peak learning rate" in text and "knobs: Knobs of a stage." in text


def test_the_printed_config_reads_back_and_keeps_secrets_out():
    values = resolve(a_flow, {"knobs": {"api_key": "k-secret", "extra_args": ["--x", "postgresql://u:pw@h/db"]}})
    text = to_yaml(values)
    assert "k-secret" not in text and "pw@" not in text
    back = yaml.safe_load(text)
    assert back["knobs"]["api_key"] is None and back["knobs"]["extra_args"][1] == "postgresql://u@h/db"
    assert resolve(a_flow, back) == resolve(a_flow, {"knobs": {"extra_args": ["--x", "postgresql://u@h/db"]}})


def test_a_section_default_must_be_its_own_defaults():
    from flows.config import parameters_model

    def bad(knobs: Knobs = Knobs(lr=1.0)):
        pass

    with pytest.raises(TypeError, match="must be Knobs()"):
        parameters_model(bad)


@pytest.mark.parametrize("url", [
    "postgresql://eagle3:s3cr3t@db:5432/eagle3",
    "postgresql://eagle3@db/eagle3?password=s3cr3t",
    "postgres://eagle3@db/eagle3?sslmode=require&password=s3cr3t",
    "host=db user=eagle3 password=s3cr3t dbname=eagle3",
    "host=db user=eagle3 password='s3 cr3t' dbname=eagle3",
])
def test_a_ledger_password_in_any_form_postgresql_accepts_is_refused_as_a_parameter_and_kept_out_of_records(url):
    """Every form libpq reads a password from (a URL's user:password@, a
    URI's ?password=, a key=value conninfo). As store.ledger_url it is
    refused before anything runs, naming the key and where the password
    goes instead: Prefect keeps a run's parameters and shows them in its UI
    (it was accepted, and sent on to every node's child run). Anywhere a
    record is written from (the kept run config, the artifact,
    --print-config: as_record), the server, database and user are kept,
    never the password (the query and conninfo forms were written
    verbatim)."""
    from psycopg.conninfo import conninfo_to_dict

    from flows.config import ConfigError, as_record, resolve

    def flow(store: StoreConfig = StoreConfig()):
        pass

    with pytest.raises(ConfigError) as refused:
        resolve(flow, {"store": {"ledger_url": url}})
    assert str(refused.value).startswith("store.ledger_url: Value error, the URL carries a password")
    assert "s3" not in str(refused.value) and "$EAGLE3_LEDGER_URL" in str(refused.value)
    assert resolve(flow, {"store": {"ledger_url": "postgresql://eagle3@db/eagle3"}})["store"].ledger_url

    record = {"store": {"path": "/data/store", "ledger_url": url}}
    kept = as_record(record)["store"]["ledger_url"]
    assert "s3" not in kept and "s3" not in to_yaml(record)
    parts = conninfo_to_dict(kept)
    assert (parts["host"], parts["user"], parts["dbname"]) == ("db", "eagle3", "eagle3") and "password" not in parts


@pytest.mark.parametrize("argv,refused", [
    (["--no-verify=false"], r"--no-verify=false: --no-verify takes no value; write --verify=false or --no-verify"),
    (["--knobs.layers", "1,2,3", "--knobs.layers", "none"], r"--knobs.layers: given as a list and as none"),
    (["--knobs.layers", "none", "--knobs.layers", "1,2"], r"--knobs.layers: given as a list and as none"),
])
def test_contradictory_command_lines_are_refused_naming_the_key(argv, refused):
    """--no-verify=false read as verify false (its value ignored), and a
    list key given as a list and then as none raised a TypeError traceback:
    each is one line naming the key, before anything runs."""
    with pytest.raises(ConfigError, match=refused):
        parse(a_flow, argv)
