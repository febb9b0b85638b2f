"""``ucm store``: look after a store's contents (placeholder, see below)."""

from __future__ import annotations

import click


@click.group()
def store() -> None:
    """Inspect and clean a store: info, ls, verify, gc, clear."""
