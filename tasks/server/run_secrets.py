"""Each launched server's own secrets: a random API key (SGLang's
`--api-key`: every request but its health and metrics endpoints needs
`Authorization: Bearer KEY`) and, for capture, a random rid prefix (the hook
captures only rids that start with it), so no other local process can use
the server or make the hook write. Both go to SGLang in a private options
file (`--config`), not on the command line, which any local user can read in
/proc; SGLang prints them into its log, which is private too, and every line
of it we pass on has the key blanked (`redact`)."""
from __future__ import annotations

import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Sequence

from tasks.capture.dump import check_rid_prefix, new_rid_prefix


def run_secrets(rid_prefix: str | None, api_key: str | None) -> tuple[str, str]:
    """A server's (rid prefix, API key): the given ones (the prefix checked),
    or fresh random ones where none is given."""
    return (new_rid_prefix() if rid_prefix is None else check_rid_prefix(rid_prefix)), api_key or new_api_key()


def new_api_key() -> str:
    """A random key SGLang's parser takes as a value: its options file becomes
    `--api-key KEY` arguments, and a key starting with '-' (1 in 64 of
    token_urlsafe's) reads as an option, so the server would not start."""
    return "k" + secrets.token_urlsafe(32)


def write_options_file(api_key: str | None, hooks: list[dict] | None) -> Path:
    """The API key and the forward hooks (on a capture server, whose config
    holds the rid prefix) in a new file only this user can read, in the form
    SGLang's `--config` takes (YAML; JSON is YAML). The caller deletes it
    once the server has read it."""
    if not api_key:
        raise ValueError("this server has no API key yet: launch it with launch_server, which draws one "
                         "(LaunchSpec.with_secrets)")
    options = {"api-key": api_key}
    if hooks is not None:
        options["forward-hooks"] = json.dumps(hooks)
    fd, path = tempfile.mkstemp(prefix="eagle3-sglang-", suffix=".yaml")  # mode 0600
    with os.fdopen(fd, "w") as f:
        json.dump(options, f)
    return Path(path)


def redact(text: str, hidden: Sequence[str | None]) -> str:
    for secret in hidden:
        if secret:
            text = text.replace(secret, "<redacted>")
    return text
