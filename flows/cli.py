"""The command line of a flow, made from its signature (flows/config.py):

    python -m flows.pipeline --config run.yaml --train.lr 3e-4 \\
        --server.dp-size 2 --server.dp-attention --server.extra-args '--max-running-requests 64'

`--config FILE` (YAML or JSON), then `--key value` overrides: a section's
field is `--section.field` (dashes or underscores), a plain parameter
`--name`. Every key takes the value after it, whatever it looks like, so an
SGLang flag can be a value (`--server.extra-args --enable-mixed-chunk`); a
list key also takes the words after that up to the next `--` word
(`--queues node-a node-b`), each split like a shell line
(`--server.extra-args '--dp-size 2 --enable-dp-attention'`), or a YAML
list (`[1, 14, 26]`), and a list key given twice adds to itself. A boolean alone means true (`--no-KEY` or `--KEY=false` for false).
`none` sets an optional key to None. `--print-config` prints the resolved
config and exits; `--help` lists every key with its default and description.

Ctrl-C or SIGTERM stops a run: its server is stopped, its lock freed, what
it committed kept; the command exits 128 + the signal's number with one line
saying what was kept and how to resume. A second signal while it stops is
ignored (the server's stop is under way)."""
from __future__ import annotations

import inspect
import json
import shlex
import signal
import sys
import textwrap
import typing
from typing import Any

import yaml

from flows.config import (ConfigError, description, is_section, load_file, parameters, resolve, section_fields,
                          strip, to_yaml)

TRUE, FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def _keys(flow) -> dict[str, tuple[Any, Any, str]]:
    """{dotted key: (annotation, default, description)} of every settable key."""
    keys = {}
    for name, (annotation, default) in parameters(flow).items():
        if is_section(annotation):
            for field, info in section_fields(annotation).items():
                keys[f"{name}.{field}"] = (info.annotation, info.get_default(call_default_factory=True),
                                           info.description or "")
        else:
            keys[name] = (annotation, default, description(annotation))
    return keys


def _kind(annotation) -> str:
    base = strip(annotation)
    if base is bool:
        return "bool"
    if typing.get_origin(base) is list:
        return "list"
    return "value"


def _type_name(annotation) -> str:
    base = strip(annotation)
    if typing.get_origin(base) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(base))) + "}"
    if typing.get_origin(base) is list:
        inner = typing.get_args(base)
        return f"LIST[{inner[0].__name__.upper() if inner else 'STR'}]"
    return getattr(base, "__name__", str(base)).upper()


def _list_value(text: str, annotation) -> list:
    if text.lstrip().startswith("["):
        return yaml.safe_load(text)
    inner = typing.get_args(strip(annotation))
    if inner and inner[0] in (int, float):
        return [t for t in text.replace(",", " ").split()]
    return shlex.split(text)


def _optional(annotation) -> bool:
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return typing.get_origin(annotation) is typing.Union and type(None) in typing.get_args(annotation)


def _value(text: str, annotation):
    base = strip(annotation)
    if text.lower() in ("none", "null") and _optional(annotation):
        return None
    if typing.get_origin(base) is list:
        return _list_value(text, annotation)
    if typing.get_origin(base) is dict or (isinstance(base, type) and base not in (str, int, float, bool)):
        return yaml.safe_load(text)
    return text  # pydantic converts "3e-4", "2", "true" to the field's type


def _get(out: dict, key: str):
    *sections, field = key.split(".")
    for s in sections:
        out = out.get(s, {})
    return out.get(field)


def _put(out: dict, key: str, value, append: bool) -> None:
    *sections, field = key.split(".")
    target = out
    for s in sections:
        target = target.setdefault(s, {})
    if append and isinstance(target.get(field), list):
        target[field] = target[field] + value
    else:
        target[field] = value


def parse(flow, argv: list[str]) -> tuple[str | None, dict, bool]:
    """(run file, overrides as a nested mapping, --print-config) from argv.
    Raises ConfigError for an unknown key or a key without its value."""
    keys = _keys(flow)
    by_spelling = {k.replace("_", "-"): k for k in keys} | {k: k for k in keys}
    config_file, overrides, print_config, seen = None, {}, False, set()
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            raise ConfigError(f"{token!r}: expected --KEY VALUE (see --help)")
        name, has_value, text = token[2:].partition("=")
        if name in ("config", "print-config", "print_config"):
            if name == "config":
                if not has_value:
                    if i >= len(argv):
                        raise ConfigError("--config needs a file")
                    text, i = argv[i], i + 1
                config_file = text
            else:
                print_config = True
            continue
        negated = name.startswith("no-") and name[3:] in by_spelling and _kind(keys[by_spelling[name[3:]]][0]) == "bool"
        key = by_spelling.get(name[3:] if negated else name)
        if key is None:
            import difflib

            near = difflib.get_close_matches(name.replace("_", "-"), [k.replace("_", "-") for k in keys], n=1)
            raise ConfigError(f"--{name}: unknown key{f' (did you mean --{near[0]}?)' if near else ''}; see --help")
        annotation = keys[key][0]
        if _kind(annotation) == "bool":
            if negated and has_value:  # --no-verify=false would read as false: refused, not guessed
                raise ConfigError(f"--{name}={text}: --{name} takes no value; write --{name[3:]}={text} or "
                                  f"--{name} alone")
            if negated:
                value = False
            elif has_value:
                value = text
            elif i < len(argv) and argv[i].lower() in TRUE | FALSE:
                value, i = argv[i], i + 1
            else:
                value = True
        else:
            if not has_value:
                if i >= len(argv):
                    raise ConfigError(f"--{name} needs a value")
                text, i = argv[i], i + 1
                # A list also takes the words after its first value, up to the next --key.
                while _kind(annotation) == "list" and i < len(argv) and not argv[i].startswith("--"):
                    text, i = f"{text} {shlex.quote(argv[i])}", i + 1
            value = _value(text, annotation)
            if key in seen and _kind(annotation) == "list" and (value is None) != (_get(overrides, key) is None):
                raise ConfigError(f"--{name}: given as a list and as none; give one of them")
        _put(overrides, key, value, append=key in seen)
        seen.add(key)
    return config_file, overrides, print_config


def help_text(flow, prog: str) -> str:
    fn = getattr(flow, "fn", flow)
    doc = (inspect.getdoc(fn) or "").split("\n\nArgs:")[0]
    width = 100
    out = [f"usage: {prog} [--config FILE] [--print-config] [--KEY VALUE ...]", "", doc, "",
           "  --config FILE       a YAML or JSON run file (a mapping of parameters, sections as mappings); "
           "the keys below override it",
           "  --print-config      print the resolved config (YAML) and exit", ""]

    def entry(key: str, annotation, default, text: str) -> None:
        shown = "required" if default is ... else f"default: {default!r}"
        head = f"  --{key.replace('_', '-')} {_type_name(annotation)}"
        body = f"{text} ({shown})" if "default" not in text or default is ... else text
        out.append(head)
        out.extend(textwrap.wrap(body, width, initial_indent="      ", subsequent_indent="      "))

    for name, (annotation, default) in parameters(flow).items():
        if is_section(annotation):
            out += ["", f"{name}: {description(annotation)}"]
            for field, info in section_fields(annotation).items():
                entry(f"{name}.{field}", info.annotation, info.get_default(call_default_factory=True),
                      info.description or "")
        else:
            entry(name, annotation, default, description(annotation))
    return "\n".join(out) + "\n"


def config_from_argv(flow, argv: list[str]) -> tuple[dict, bool]:
    """(the resolved parameters, --print-config) for a command line."""
    config_file, overrides, print_config = parse(flow, argv)
    layers = [load_file(config_file)] if config_file else []
    return resolve(flow, *layers, overrides), print_config


def run_cli(flow, prog: str, argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(flow, prog), end="")
        raise SystemExit(0)
    try:
        values, print_config = config_from_argv(flow, argv)
    except ConfigError as e:
        print(f"{prog}: config error:\n" + textwrap.indent(str(e), "  "), file=sys.stderr)
        raise SystemExit(2) from None
    if print_config:
        print(to_yaml(values), end="")
        return values
    from prefect import Flow

    from flows.local_api import local_prefect_api

    if not isinstance(flow, Flow):  # a plain command (flows/node.py), which handles its own stop
        return flow(**values)
    received: list[int] = []

    def stop(signum, frame):
        received.append(signum)
        if len(received) == 1:
            raise KeyboardInterrupt
        print(f"{prog}: already stopping (its server is being stopped); SIGKILL would leave it running",
              file=sys.stderr)

    # SIGTERM (a scheduler's, `timeout`'s) stops a run as Ctrl-C does.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stop)
    try:
        with local_prefect_api():
            result = flow(**values)
    except KeyboardInterrupt:
        signum = received[0] if received else signal.SIGINT
        from flows.run_record import kept

        what = kept(values)
        print(f"{prog}: stopped by {signal.Signals(signum).name}; "
              + (f"{what}; run the same command again to resume" if what else "run the same command again"),
              file=sys.stderr)
        raise SystemExit(128 + signum) from None
    if result is not None:
        print(json.dumps(result, indent=2, default=str))
    return result
