"""Jinja2 for the cards: the templates in card/templates/ hold each document's headings, prose and order."""

from __future__ import annotations

import html
from functools import cache
from pathlib import Path

import jinja2

from moeflow.card.sections import RUN_RECORD

TEMPLATES = Path(__file__).parent / "templates"


@cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=False,  # Markdown; the SVG escapes its text with `xml`, the HTML body is already HTML
        keep_trailing_newline=True,
        trim_blocks=True,  # a line holding only a block tag leaves no line behind
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,  # a misspelt name fails the render instead of printing nothing
    )
    env.filters["commas"] = "{:,}".format
    env.filters["xml"] = html.escape  # markupsafe's escape writes quotes differently
    env.globals["RUN_RECORD"] = RUN_RECORD  # tests and readers find the section by this heading
    return env


def render(template: str, **context) -> str:
    """`card/templates/<template>` filled from `context`."""
    return _environment().get_template(template).render(**context)
