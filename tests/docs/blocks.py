"""The fenced code blocks of the user guide (docs/guide/*.md) and the marks before them.

A mark is an HTML comment on the line(s) right before a block's opening fence:

- ``<!-- session: NAME -->``: the block shares a session (working directory, exported variables, one Python
  interpreter) with the page's other blocks of that session; without it a block runs alone.
- ``<!-- file: NAME -->``: the block is not run but written to NAME in its session's directory (a training
  script, a job spec) for the blocks after it to use.
- ``<!-- not run: REASON -->``: the block cannot run here cheaply; REASON says why and what covers it instead.

How each language is handled is :data:`RUN` (executed), :data:`PARSED` (parsed and validated) and otherwise
nothing: such a block must carry a ``not run`` mark with its reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide"
RUN = ("python", "bash", "console")
PARSED = ("yaml", "json", "toml")
_FENCE = re.compile(r"^```([\w+-]*)\s*$")
_MARK = re.compile(r"^<!--\s*(session|file|not run):\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a guide page."""

    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    session: str | None = None
    file: str | None = None
    not_run: str | None = None

    @property
    def where(self) -> str:
        """``page.md:LINE`` for messages."""
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """Every page of the guide, in name order."""
    return sorted(GUIDE.glob("*.md"))


def parse(path: Path) -> list[Block]:
    """The fenced blocks of one page with their marks (raises ``ValueError`` on an unclosed fence)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    marks: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        mark = _MARK.match(line)
        fence = _FENCE.match(line)
        if mark:
            marks[mark.group(1)] = mark.group(2)
        elif fence:
            start = i
            i += 1
            body: list[str] = []
            while i < len(lines) and lines[i].rstrip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{path.name}:{start + 1}: the code block is never closed")
            blocks.append(Block(path.name, start + 1, fence.group(1), "\n".join(body) + "\n",
                                marks.get("session"), marks.get("file"), marks.get("not run")))  # fmt: skip
            marks = {}
        elif line.strip():
            marks = {}  # a mark belongs to the block right after it
        i += 1
    return blocks
