"""mkdocs hook: the operator reference documents every curvature row.

``docs/reference/operators.md`` places the shipped operators by hand, with their prose; a row
whose class has no ``::: module.Class`` entry there yet (a new built-in curvature, which
is one module plus one registry row) gets its entries where the page has
:data:`MARKER`, under a heading of its own, so the row is the one place to add it.
``tests/operators/test_registry.py`` checks the page through :func:`with_registry_entries`.
"""

from __future__ import annotations

from typing import Any

MARKER = "<!-- registry rows without an entry above: added here by scripts/docs_registry.py -->"


def with_registry_entries(markdown: str) -> str:
    """``markdown`` with a ``::: module.Class`` entry for every row class it does not document."""
    from hessian_eigenthings.operators import registry

    missing: list[str] = []
    for row in registry.curvatures():
        cls = row.operator_class()
        entry = f"::: {cls.__module__}.{cls.__qualname__}\n"
        if entry not in markdown and entry not in missing:
            missing.append(entry)
    section = "## More curvatures\n\n" + "\n".join(missing) if missing else ""
    return markdown.replace(MARKER, section, 1)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri != "reference/operators.md":
        return markdown
    return with_registry_entries(markdown)
