"""Say why a lookup missed: which key ingredients differ from the nearest stored entry.

Stored manifests are read as data someone else may have written: whatever their
``ingredient_values`` hold (deep nesting, odd types), explaining never fails; at worst it
says the stored value is unreadable.
"""

from __future__ import annotations

import json

from .artifact import read_manifest
from .errors import SpmdAotError
from .key import CacheKey

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
    try:
        return _explain_miss(store, key)
    except Exception as exc:  # a message must never turn a miss into another failure
        return f"(Could not compare with the stored entries: {type(exc).__name__}: {str(exc)[:120]}.)"


def _explain_miss(store, key: CacheKey) -> str:
    best = nearest_entry(store, key)
    if best is None:
        return "The cache holds no artifacts."
    stored_key, manifest, differ = best
    if not differ:
        return f"Entry {stored_key[:12]} has the same ingredients."
    values = manifest.get("ingredient_values", {})
    values = values if isinstance(values, dict) else {}
    parts = [f"{name} ({first_difference(values.get(name), key.values.get(name))})" for name in differ]
    return f"Nearest stored entry {stored_key[:12]} differs in: " + "; ".join(parts) + "."


def first_difference(stored, live, where: str = "", depth: int = 0) -> str:
    """'at <path>: stored X, live Y' for where two JSON values differ (every key of a map)."""
    try:
        if depth < _MAX_DEPTH and isinstance(stored, dict) and isinstance(live, dict):
            keys = [k for k in sorted(set(stored) | set(live), key=str) if stored.get(k) != live.get(k)]
            return ", ".join(first_difference(stored.get(k), live.get(k), f"{where}.{k}", depth + 1)
                             for k in keys[:_MAX_KEYS])
        if (depth < _MAX_DEPTH and isinstance(stored, list) and isinstance(live, list)
                and len(stored) == len(live)
                and any(isinstance(x, (list, dict)) for x in stored)):  # shapes are shown whole
            for i, (a, b) in enumerate(zip(stored, live)):
                if a != b:
                    return first_difference(a, b, f"{where}[{i}]", depth + 1)
    except RecursionError:  # comparing values nested deeper than Python recurses
        pass
    at = f"at {where.lstrip('.')}: " if where else ""
    return f"{at}stored {_short(stored)}, live {_short(live)}"


_MAX_DEPTH, _MAX_KEYS = 16, 20


def _short(value, limit: int = 160) -> str:
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    except (TypeError, ValueError, RecursionError):
        text = "(unreadable stored value)"
    return text if len(text) <= limit else text[: limit - 3] + "..."
