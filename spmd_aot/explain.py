"""Say why a lookup missed: which key ingredients differ from the nearest stored entry."""

from __future__ import annotations

import json

from .artifact import read_manifest
from .errors import SpmdAotError
from .key import CacheKey

__all__ = ["explain_miss", "nearest_entry"]


def nearest_entry(store, key: CacheKey):
    """(stored key, manifest, differing ingredient names) of the closest entry, or None."""
    best = None
    for stored_key, digest in store.refs().items():
        try:
            manifest = read_manifest(store, digest)
        except SpmdAotError:
            continue
        stored = manifest.get("ingredients", {})
        differ = [n for n, d in key.ingredients.items() if stored.get(n) != d]
        if best is None or len(differ) < len(best[2]):
            best = (stored_key, manifest, differ)
    return best


def explain_miss(store, key: CacheKey) -> str:
    best = nearest_entry(store, key)
    if best is None:
        return "The cache holds no artifacts."
    stored_key, manifest, differ = best
    if not differ:
        return f"Entry {stored_key[:12]} has the same ingredients."
    values = manifest.get("ingredient_values", {})
    parts = [f"{name} (stored {_short(values.get(name))}, live {_short(key.values.get(name))})"
             for name in differ]
    return f"Nearest stored entry {stored_key[:12]} differs in: " + "; ".join(parts) + "."


def _short(value, limit: int = 160) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= limit else text[: limit - 3] + "..."
