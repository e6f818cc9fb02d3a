"""What a launched server's log says, passed on without its secrets: the
lines it gained since the last look, for the run's own log, and its last
lines, for errors. The log itself is private (SGLang prints its API key into
it); everything read from it here has the key blanked."""
from __future__ import annotations

import ast
import logging
import os
from pathlib import Path
from typing import Sequence

from tasks.server.flags import SHOWN
from tasks.server.run_secrets import redact


def log_tail(path: Path, lines: int = 40, hidden: Sequence[str | None] = ()) -> str:
    """The last lines of a server log, with the `hidden` strings blanked
    (SGLang prints its arguments, API key included, when it starts)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no server log)"
    return redact("\n".join(text.splitlines()[-lines:]), hidden)


# SGLang logs all of its ~400 settings at start-up as one line of some 20,000
# characters (`server_args={...}`); the run's log gets those the launcher's
# table marks (flags.py SHOWN), the server's log keeps the line whole.
def summarize_server_args(line: str, where: Path) -> str | None:
    """SGLang's start-up line of its settings cut to SHOWN (those it
    sets), with a pointer to `where` the whole line is; None for any other
    line."""
    head, found, settings = line.partition("server_args=")
    if not found or not settings.startswith("{"):
        return None
    try:
        values = ast.literal_eval(settings)
    except (ValueError, SyntaxError):
        return None
    shown = ", ".join(f"{k}={values[k]!r}" for k in SHOWN if values.get(k) is not None)
    return f"{head}server_args: {shown} (all of them: {where})"


class LogFollower:
    """Reads the lines a server log gained since the last call, so a person
    watching the run sees the server's own words (warnings, errors, start-up)."""

    def __init__(self, path: Path):
        self.path, self.pos = Path(path), 0
        self.hidden: set[str] = set()

    def hide(self, secret: str | None) -> None:
        """Blank `secret` in every line passed on (SGLang logs its API key)."""
        if secret:
            self.hidden.add(secret)

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # only whole lines
        self.pos += end
        return redact(data[:end].decode("utf-8", "replace"), sorted(self.hidden)).splitlines()

    def forward(self, log: logging.Logger, *, everything: bool = False) -> None:
        for line in self.new_lines():
            line = summarize_server_args(line, self.path) or line
            if any(w in line for w in ("ERROR", "Error", "Traceback", "WARNING", "Warning")):
                log.warning("sglang: %s", line)
            elif everything:
                log.info("sglang: %s", line)
