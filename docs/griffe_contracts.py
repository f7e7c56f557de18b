"""Griffe extension: render a hook's four contract lines as a list in the API reference.

In the source a hook states its contract as four labelled lines (`Called when:`, `Holds on entry:`,
`Side effects:`, `Overrides must not:`), long ones continued on indented lines. The Google
docstring parser would read a label followed by an indented line as an admonition, and the lines
would otherwise run together into one paragraph; this rewrites them, for the rendered page only,
into one list item per label.
"""

from __future__ import annotations

from typing import Any

import griffe

LABELS = ("Called when:", "Holds on entry:", "Side effects:", "Overrides must not:")


def contract_as_list(text: str) -> str:
    """`text` with each contract line and its indented continuation turned into one list item."""
    lines = text.splitlines()
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        label = next((label for label in LABELS if line.startswith(label)), None)
        if label is None:
            out.append(line)
            index += 1
            continue
        parts = [line[len(label) :].strip()]
        index += 1
        while index < len(lines) and lines[index].startswith((" ", "\t")) and lines[index].strip():
            parts.append(lines[index].strip())
            index += 1
        if out and out[-1].strip() and not out[-1].startswith("- **"):
            out.append("")  # a list needs a blank line before it
        out.append(f"- **{label}** {' '.join(parts)}")
        if index < len(lines) and lines[index].strip() and not lines[index].startswith(LABELS):
            out.append("")  # and after it
    return "\n".join(out)


class HookContracts(griffe.Extension):
    """Rewrite the contract lines of every function's docstring before it is parsed."""

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        docstring = func.docstring
        if docstring is not None and any(label in docstring.value for label in LABELS):
            docstring.value = contract_as_list(docstring.value)
