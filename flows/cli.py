"""A command line for a flow, made from the flow's own signature, so the CLI,
the Prefect UI's run form and the Python API share one set of parameters,
names, defaults and descriptions (`Annotated[..., Field(description=...)]`).

Prefect 3.9 takes the UI form's descriptions from a Google-style `Args:`
docstring section only, so `described` writes that section from the same
annotations (apply it under `@flow`)."""
from __future__ import annotations

import argparse
import inspect
import json
import typing


def _describe(annotation) -> tuple[type, str]:
    base, help_text = annotation, ""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *meta = typing.get_args(annotation)
        help_text = next((m.description for m in meta if getattr(m, "description", None)), "")
    return base, help_text


def described(fn):
    """Append an `Args:` section, made from the parameters' Field
    descriptions, to the flow function's docstring."""
    hints = typing.get_type_hints(fn, include_extras=True)
    lines = [f"    {name}: {text}" for name in inspect.signature(fn).parameters
             if (text := _describe(hints[name])[1])]
    if lines:
        fn.__doc__ = (inspect.getdoc(fn) or "") + "\n\nArgs:\n" + "\n".join(lines) + "\n"
    return fn


def build_parser(flow, prog: str) -> argparse.ArgumentParser:
    fn = flow.fn
    parser = argparse.ArgumentParser(prog=prog, description=(inspect.getdoc(fn) or "").split("\n\nArgs:")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(fn, include_extras=True)
    for name, param in inspect.signature(fn).parameters.items():
        base, help_text = _describe(hints[name])
        args = typing.get_args(base)
        if typing.get_origin(base) is typing.Union:  # Optional[X]
            base = next(a for a in args if a is not type(None))
            args = typing.get_args(base)
        # A description that explains its default itself ("default: ...") keeps its own words.
        if param.default is inspect.Parameter.empty:
            kw: dict = {"required": True, "help": help_text}
        else:
            shown = help_text if "default" in help_text else f"{help_text} (default: {param.default!r})"
            kw = {"default": param.default, "help": shown}
        origin = typing.get_origin(base)
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif origin is typing.Literal:
            kw["choices"] = list(args)
        elif origin is list:
            kw["nargs"] = "*"
            kw["type"] = args[0] if args else str
        elif base in (int, float, str):
            kw["type"] = base
        else:
            kw["type"] = json.loads
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, **kw)
    return parser


def run_cli(flow, prog: str, argv=None):
    args = build_parser(flow, prog).parse_args(argv)
    result = flow(**vars(args))
    print(json.dumps(result, indent=2, default=str))
    return result
