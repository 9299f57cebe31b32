"""docs/integrations.md's command lines, for the per-engine tests that parse them with each engine's own parser."""

from __future__ import annotations

import shlex
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def commands(program: str) -> list[list[str]]:
    """The argv of every one-line command in a ```sh block of the doc that starts with `program`."""
    text = DOC.read_text()
    out = []
    for block in text.split("```sh\n")[1:]:
        for line in block.split("```", 1)[0].splitlines():
            if line.startswith(program + " "):
                out.append(shlex.split(line))
    return out
