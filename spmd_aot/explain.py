"""Say why a lookup missed: which key ingredients differ from the nearest stored entry, or,
for an entry of the same key, which guard (a file, a distribution, a tensor value) failed."""

from __future__ import annotations

import json

from .artifact import read_manifest
from .errors import SpmdAotError
from .key import CacheKey
from .lookup import find_entry

__all__ = ["explain_miss", "nearest_entry", "first_difference"]


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
        try:
            found = find_entry(store, key)
        except SpmdAotError as exc:
            return f"Entry {stored_key[:12]} has the same ingredients but is unusable: {exc}."
        if found.misses:
            return (f"Entry {stored_key[:12]} has the same ingredients, but what its trace depended "
                    f"on differs here: {found.explain()}.")
        return f"Entry {stored_key[:12]} has the same ingredients."
    values = manifest.get("ingredient_values", {})
    parts = [f"{name} ({first_difference(values.get(name), key.values.get(name))})" for name in differ]
    return f"Nearest stored entry {stored_key[:12]} differs in: " + "; ".join(parts) + "."


def first_difference(stored, live, where: str = "") -> str:
    """'at <path>: stored X, live Y' for where two JSON values differ (every key of a map)."""
    if isinstance(stored, dict) and isinstance(live, dict):
        keys = [k for k in sorted(set(stored) | set(live), key=str) if stored.get(k) != live.get(k)]
        return ", ".join(first_difference(stored.get(k), live.get(k), f"{where}.{k}") for k in keys)
    if (isinstance(stored, list) and isinstance(live, list) and len(stored) == len(live)
            and any(isinstance(x, (list, dict)) for x in stored)):  # shapes are shown whole
        for i, (a, b) in enumerate(zip(stored, live)):
            if a != b:
                return first_difference(a, b, f"{where}[{i}]")
    at = f"at {where.lstrip('.')}: " if where else ""
    return f"{at}stored {_short(stored)}, live {_short(live)}"


def _short(value, limit: int = 160) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= limit else text[: limit - 3] + "..."
