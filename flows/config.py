"""A flow's run config: the values of its parameters, resolved in one order
and checked by one model, whichever way the run was started.

    the flow's defaults  <  a YAML or JSON run file  <  dotted overrides

A flow's parameters are plain values or whole sections (tasks/config.py),
so a run file reads

    server: {model: /models/kimi-k2.5, tp_size: 8, dp_size: 8, dp_attention: true}
    train: {lr: 3.0e-4, sharding: fsdp}

and an override names `section.field`. `parameters_model(flow)` is the
pydantic model of a flow's whole signature (its sections nested): Prefect
builds the UI's run form from the same signature, so the form, the command
line and the Python API cannot disagree. Unknown keys, wrong types and
out-of-range values are refused naming the key (`ConfigError`).
"""
from __future__ import annotations

import difflib
import functools
import inspect
import json
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from tasks.config import Section


class ConfigError(ValueError):
    """A run config that cannot be used; the message names every bad key."""


def _function(flow):
    return getattr(flow, "fn", flow)


def strip(annotation) -> type:
    """The type under Annotated[...] and Optional[...]."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            annotation = args[0]
    return annotation


def is_section(annotation) -> bool:
    base = strip(annotation)
    return isinstance(base, type) and issubclass(base, Section)


def parameters(flow) -> dict[str, tuple[Any, Any]]:
    """{name: (annotation, default or ...)} of the flow's signature."""
    fn = _function(flow)
    hints = typing.get_type_hints(fn, include_extras=True)
    return {name: (hints[name], ... if p.default is inspect.Parameter.empty else p.default)
            for name, p in inspect.signature(fn).parameters.items()}


@functools.cache
def _model(fn) -> type[BaseModel]:
    fields = parameters(fn)
    for name, (annotation, default) in fields.items():
        # Prefect validates a run's partial section ({"train": {"lr": 1}})
        # against the section's own defaults, not the flow's default
        # instance: the two must be the same, or the UI and the CLI would
        # resolve one config two ways.
        if is_section(annotation) and default is not ... and default != strip(annotation)():
            raise TypeError(f"{fn.__qualname__}: the default of section parameter {name!r} must be "
                            f"{strip(annotation).__name__}() (its own defaults)")
    return create_model(f"{fn.__name__}_config", __config__=ConfigDict(extra="forbid"), **fields)


def description(annotation) -> str:
    """What the UI form says of a parameter: its Field's description, else
    its section's docstring."""
    if typing.get_origin(annotation) is typing.Annotated:
        text = next((m.description for m in typing.get_args(annotation)[1:] if getattr(m, "description", None)), "")
        if text:
            return text
    if is_section(annotation):
        # The section's own docstring: pydantic's BaseModel has one of its own.
        doc = inspect.cleandoc(strip(annotation).__dict__.get("__doc__") or "")
        return " ".join(doc.split("\n\n")[0].split())
    return ""


def described(fn):
    """Append an `Args:` section, made from the parameters' descriptions,
    to the flow function's docstring: Prefect 3.9 takes the UI form's
    descriptions of a flow's parameters from a Google-style `Args:` section
    only (apply it under `@flow`); a section's fields carry their own."""
    lines = [f"    {name}: {text}" for name, (annotation, _) in parameters(fn).items()
             if (text := description(annotation))]
    if lines:
        fn.__doc__ = (inspect.getdoc(fn) or "") + "\n\nArgs:\n" + "\n".join(lines) + "\n"
    return fn


def checked(rule):
    """Declare a rule across a flow's parameters: `rule` takes some of them
    by name and raises ValueError naming the key. resolve() applies it to
    every config it resolves, so the command line refuses what the flow
    would, before anything runs; the flow applies it first too (a run from
    the UI is not resolved here)."""
    def declare(fn):
        fn.config_rule = rule
        return fn
    return declare


def parameters_model(flow) -> type[BaseModel]:
    """The pydantic model of the flow's parameters: each section a nested model."""
    return _model(_function(flow))


def load_file(path: str | Path) -> dict:
    """A run file: YAML (JSON is YAML) holding one mapping."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"run file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"run file {path} is not YAML or JSON: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"run file {path} holds a {type(data).__name__}, not a mapping of parameters to values "
                          f"(e.g. `train: {{lr: 3.0e-4}}`)")
    return data


def merge(base: dict, update: dict) -> dict:
    """`update` over `base`, sections merged key by key (lists replaced)."""
    out = dict(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def resolve(flow, *layers: dict) -> dict[str, Any]:
    """The flow's parameters from its defaults and the given layers (a run
    file's mapping, then overrides), validated: {name: value or section}.
    Raises ConfigError naming every key that is wrong."""
    fields = parameters(flow)
    merged: dict = {}
    for name, (annotation, default) in fields.items():
        if default is not ...:
            merged[name] = default.model_dump() if isinstance(default, BaseModel) else default
    for layer in layers:
        merged = merge(merged, layer)
    try:
        validated = parameters_model(flow).model_validate(merged)
    except ValidationError as e:
        raise ConfigError(describe(e, flow)) from None
    values = {name: getattr(validated, name) for name in fields}
    rule = getattr(_function(flow), "config_rule", None)
    if rule is not None:
        try:
            rule(**{name: values[name] for name in inspect.signature(rule).parameters if name in values})
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return values


def describe(error: ValidationError, flow) -> str:
    """One line per problem, each naming its dotted key."""
    fields = parameters(flow)
    lines = []
    for err in error.errors():
        loc = [str(part) for part in err["loc"]]
        key = ".".join(loc)
        if err["type"] == "extra_forbidden":
            known = _keys_at(fields, loc[:-1])
            near = difflib.get_close_matches(loc[-1], known, n=1)
            where = f"{'.'.join(loc[:-1])} takes" if len(loc) > 1 else "the parameters are"
            lines.append(f"{key}: unknown key{f' (did you mean {near[0]!r}?)' if near else ''}; {where}: "
                         f"{', '.join(known)}")
        elif err["type"] == "missing":
            lines.append(f"{key}: required, and not given")
        else:
            given = err.get("input")
            shown = ("" if isinstance(given, (dict, BaseModel)) or loc[-1] in SECRET_FIELDS else
                     f" (given: {(without_password(given) if isinstance(given, str) else given)!r})")
            lines.append(f"{key}: {err['msg']}{shown}")
    return "\n".join(lines)


def _keys_at(fields: dict, loc: list[str]) -> list[str]:
    if not loc:
        return list(fields)
    annotation = fields.get(loc[0], (None,))[0]
    if is_section(annotation) and len(loc) == 1:
        return list(strip(annotation).model_fields)
    return []


def section_fields(annotation) -> dict:
    return strip(annotation).model_fields


# Never written into a kept config, an artifact or a printout: an attached
# or baseline server's API key; a ledger URL's password (given in $EAGLE3_LEDGER_URL,
# PGPASSWORD or ~/.pgpass instead, tasks/store/ledger/).
SECRET_FIELDS = {"api_key", "baseline_api_key"}
_URL_PASSWORD = re.compile(r"(://[^:/@]*):[^@/]*@")
_PASSWORD_PARAM = re.compile(r"""\bpassword\s*=\s*('(?:[^'\\]|\\.)*'|[^\s&]*)&?""")


def without_password(value: str) -> str:
    """`value` with any password left out: a URL's (scheme://user:pass@),
    and every form PostgreSQL accepts, read by libpq's own parser (a URI's
    ?password=, a key=value conninfo's password=...)."""
    value = _URL_PASSWORD.sub(r"\1@", value)
    if "password" not in value:
        return value
    from psycopg.conninfo import conninfo_to_dict

    from tasks.store.ledger.postgres import public_url

    try:
        parts = conninfo_to_dict(value)
    except Exception:  # noqa: BLE001 - not a conninfo: any password= in it goes all the same
        return _PASSWORD_PARAM.sub("", value)
    return public_url(value) if "password" in parts else value


def as_record(values: dict[str, Any]) -> dict:
    """Resolved parameters as plain data, secrets left out (None; a URL
    keeps its user, not its password), so that the record can be rerun with
    the secrets from the environment."""
    def clean(key: str, value):
        if isinstance(value, BaseModel):
            return {k: clean(k, v) for k, v in value.model_dump(mode="json").items()}
        if isinstance(value, dict):
            return {k: clean(k, v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean("", v) for v in value]
        if key in SECRET_FIELDS:
            return None  # a rerun of the record takes it from the environment
        if isinstance(value, str):
            return without_password(value)
        if isinstance(value, Path):
            return str(value)
        return value

    return {k: clean(k, v) for k, v in values.items()}


def to_yaml(values: dict[str, Any]) -> str:
    return yaml.safe_dump(json.loads(json.dumps(as_record(values), default=str)), sort_keys=False)
