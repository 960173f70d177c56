"""mkdocs hooks: tables the guide generates from the code at build time, so they cannot go stale.

- ``<!-- options: KafkaOptions -->`` becomes the table of that model's ``sr.`` options
  (streamrover/sources/options.py: key, default, accepted forms).
- ``<!-- jobspec-schema -->`` becomes the job spec's JSON schema (streamrover/operator/spec.py).

``expand`` is what the hook applies; tests/docs/test_guide.py calls it too.
"""

from __future__ import annotations

import re
from typing import Any

_OPTIONS = re.compile(r"^<!-- options: (\w+) -->$", re.MULTILINE)
_SCHEMA = re.compile(r"^<!-- jobspec-schema -->$", re.MULTILINE)


def _options_table(match: re.Match[str]) -> str:
    from streamrover.sources import options

    model = getattr(options, match.group(1))
    rows = ["| option | default | accepted |", "| --- | --- | --- |"]
    for name, field in model.model_fields.items():
        key = field.alias or name
        default = "" if field.default is None else str(field.default)
        rows.append(f"| `{key}` | `{default}` | {(field.description or '').replace('|', '/')} |")
    return "\n".join(rows)


def _schema(match: re.Match[str]) -> str:
    from streamrover.operator.spec import schema_text

    return "```json\n" + schema_text() + "```"


def expand(markdown: str) -> str:
    """The page's markdown with every generated table in place of its marker."""
    return _SCHEMA.sub(_schema, _OPTIONS.sub(_options_table, markdown))


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs' hook: expand the markers of every page."""
    return expand(markdown)
