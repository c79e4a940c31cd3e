"""Say why a lookup missed: which key ingredients differ from the nearest stored entry, or,
for an entry of the same key, which guard (a file, a distribution, a tensor value) failed.

Stored manifests are read as data someone else may have written: whatever their
``ingredient_values`` hold (deep nesting, odd types), explaining never fails; at worst it
says the stored value is unreadable. And whatever the cache holds, explaining does bounded
work: it compares with at most ``MAX_REFS`` refs, reads each distinct manifest once, skips one
larger than ``MAX_MANIFEST_BYTES`` unread (a ref may name a 255 MiB blob) and stops reading
after ``MAX_TOTAL_BYTES``; the message says when it compared with only some entries.
"""

from __future__ import annotations

import json

from ..entries import read_manifest
from ..errors import SpmdAotError
from .key import CacheKey
from .lookup import find_entry

__all__ = ["explain_miss", "nearest_entry", "first_difference"]


# What one explanation may read: manifests of real steps are 10-200 KiB (a 48-layer
# transformer's: 133 KiB), so these caps only ever cut a cache someone filled on purpose.
MAX_REFS = 256
MAX_MANIFEST_BYTES = 4 << 20
MAX_TOTAL_BYTES = 8 << 20


class _Capped:
    """A store whose ``get`` reads at most ``limit`` bytes: ``read_manifest`` asks for a
    manifest's load limit (256 MiB); an explanation allows far less, also when a blob grows
    between its ``size`` and its read."""

    def __init__(self, store, limit: int) -> None:
        self.store, self.limit = store, limit

    def get(self, digest: str, *, limit: int | None = None) -> bytes:
        return self.store.get(digest, limit=self.limit if limit is None else min(limit, self.limit))

    def __getattr__(self, name):
        return getattr(self.store, name)


def nearest_entry(store, key: CacheKey):
    """(stored key, manifest, differing ingredient names) of the closest entry, or None."""
    return _nearest(store, key)[0]


def _nearest(store, key: CacheKey):
    """(``nearest_entry``'s answer, how many refs were compared, how many there are), within
    the caps above."""
    best = None
    keys = store.ref_keys()
    capped, read, manifests = _Capped(store, MAX_MANIFEST_BYTES), 0, {}
    for stored_key in keys[:MAX_REFS]:
        try:
            digest = store.get_ref(stored_key)
            if digest is None:
                continue
            if digest not in manifests:
                size = store.size(digest)
                manifests[digest] = None  # missing, too large, past the budget or unreadable: skipped
                if size is None or size > MAX_MANIFEST_BYTES or read + size > MAX_TOTAL_BYTES:
                    continue
                read += size
                manifests[digest] = read_manifest(capped, digest)
            manifest = manifests[digest]
        except SpmdAotError:
            continue
        if manifest is None:
            continue
        stored = manifest.get("ingredients", {})
        differ = [n for n, d in key.ingredients.items() if stored.get(n) != d]
        if best is None or len(differ) < len(best[2]):
            best = (stored_key, manifest, differ)
    return best, min(len(keys), MAX_REFS), len(keys)


def explain_miss(store, key: CacheKey) -> str:
    try:
        return _explain_miss(store, key)
    except Exception as exc:  # a message must never turn a miss into another failure
        return f"(Could not compare with the stored entries: {type(exc).__name__}: {str(exc)[:120]}.)"


def _explain_miss(store, key: CacheKey) -> str:
    best, compared, total = _nearest(store, key)
    if best is None:
        if total:
            return f"No readable artifact among the {compared} of {total} stored entries compared."
        return "The cache holds no artifacts."
    stored_key, manifest, differ = best
    text = _explain_nearest(store, key, stored_key, manifest, differ)
    return text + (f" (Compared with {compared} of the {total} stored entries.)" if compared < total else "")


def _explain_nearest(store, key: CacheKey, stored_key: str, manifest: dict, differ: list[str]) -> str:
    if not differ:
        try:
            found = find_entry(_Capped(store, MAX_MANIFEST_BYTES), key)
        except SpmdAotError as exc:
            return f"Entry {stored_key[:12]} has the same ingredients but is unusable: {exc}."
        if found.misses:
            return (f"Entry {stored_key[:12]} has the same ingredients, but what its trace depended "
                    f"on differs here: {found.explain()}.")
        return f"Entry {stored_key[:12]} has the same ingredients."
    values = manifest.get("ingredient_values", {})
    values = values if isinstance(values, dict) else {}
    parts = [f"{name} ({first_difference(values.get(name), key.values.get(name))})" for name in differ]
    return f"Nearest stored entry {stored_key[:12]} differs in: " + "; ".join(parts) + "."


_SCALAR_TAGS = ("float", "int", "str", "enum", "dtype", "device")  # the key's scalar forms


def _tag(v) -> str | None:
    """The scalar tag of a fingerprinted value ({"float": "0.5"} -> "float"), else None."""
    if isinstance(v, dict):
        tags = [t for t in _SCALAR_TAGS if t in v]
        return tags[0] if len(tags) == 1 and set(v) <= {tags[0], "type"} else None
    return None


def first_difference(stored, live, where: str = "") -> str:
    """'at <path>: stored X, live Y' for where two JSON values differ (every key of a map).

    Code is named, not shown as hashes: 'the file defining train_step changed'. Lists of
    per-module or per-parameter entries are matched by FQN, so a changed attribute reads
    'at blocks.0.attn.n_heads: stored 4, live 8' and an added parameter is named. Never
    raises, whatever a stored manifest holds.
    """
    try:
        return _difference(stored, live, where, 0)
    except Exception:  # odd stored content (deep nesting, unhashable names): say so, never fail
        at = f"at {where.lstrip('.')}: " if where else ""
        return f"{at}the stored value is unreadable"


_MAX_DEPTH, _MAX_KEYS = 16, 20


def _difference(stored, live, where: str, depth: int) -> str:
    if depth >= _MAX_DEPTH:
        at = f"at {where.lstrip('.')}: " if where else ""
        return f"{at}stored {_short(stored)}, live {_short(live)}"
    if _tag(stored) is not None and _tag(stored) == _tag(live):  # {"float": "0.5"}: show the value
        stored, live = stored[_tag(stored)], live[_tag(live)]
    at = f"at {where.lstrip('.')}: " if where else ""
    if _is_code(stored) and _is_code(live) and stored.get("name") == live.get("name"):
        return at + _code_difference(stored, live, depth)
    if isinstance(stored, dict) and isinstance(live, dict):
        keys = [k for k in sorted(set(stored) | set(live), key=str) if stored.get(k) != live.get(k)]
        return ", ".join(_difference(stored.get(k), live.get(k), f"{where}.{k}", depth + 1)
                         for k in keys[:_MAX_KEYS])
    if isinstance(stored, list) and isinstance(live, list):
        stored_named, live_named = _by_name(stored), _by_name(live)
        if stored_named is not None and live_named is not None:
            return _named_difference(stored_named, live_named, where, depth)
        if len(stored) == len(live) and any(isinstance(x, (list, dict)) for x in stored):
            for i, (a, b) in enumerate(zip(stored, live)):  # shapes (flat lists) are shown whole
                if a != b:
                    return _difference(a, b, f"{where}[{i}]", depth + 1)
    return f"{at}stored {_short(stored)}, live {_short(live)}"


def _is_code(value) -> bool:
    """A code identity from the key: a qualified name with digests of its file and own code."""
    return isinstance(value, dict) and isinstance(value.get("name"), str) and "file" in value


def _code_difference(stored: dict, live: dict, depth: int) -> str:
    name = live["name"]
    parts = []
    if stored.get("code") != live.get("code"):
        parts.append(f"the code of {name} changed")
    elif stored.get("file") != live.get("file"):
        parts.append(f"the file defining {name} changed ({name} itself did not: code beside it did)")
    rest = {k: stored.get(k) for k in set(stored) | set(live) if k not in ("name", "code", "file")}
    other = {k: live.get(k) for k in rest}
    if rest != other:
        parts.append(_difference(rest, other, "", depth + 1))
    return "; ".join(parts)


def _by_name(items: list):
    """{name: item} when every item is named: a code identity by its qualified name, a module or
    parameter entry by its FQN (first element, or the first of its list of names); else None."""
    out = {}
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("name"), str):  # code, or a torch class
            name = item["name"]
        elif isinstance(item, list) and item and isinstance(item[0], str):
            name = item[0]
        elif isinstance(item, list) and item and isinstance(item[0], list) and item[0] \
                and all(isinstance(n, str) for n in item[0]):
            name = item[0][0]
        else:
            return None
        if name in out:
            return None
        out[name] = item
    return out


def _named_difference(stored: dict, live: dict, where: str, depth: int, limit: int = 4) -> str:
    parts = []
    for names, side in (([n for n in stored if n not in live], "stored entry"),
                        ([n for n in live if n not in stored], "live job")):
        if names:
            shown = ", ".join(n or "<root>" for n in names[:limit])
            parts.append(f"{shown}{f' and {len(names) - limit} more' if len(names) > limit else ''} "
                         f"only in the {side}")
    changed = []
    for name, item in live.items():
        old = stored.get(name)
        if old is None or old == item:
            continue
        path = f"{where}.{name or '<root>'}"
        if isinstance(old, dict):
            changed.append(_difference(old, item, path, depth + 1))
        elif len(old) == len(item):  # [fqn, fields...]: name the differing field
            changed += [_difference(a, b, path, depth + 1) for a, b in zip(old, item) if a != b]
        else:
            changed.append(f"at {path.lstrip('.')}: stored {_short(old)}, live {_short(item)}")
    if len(changed) > limit:
        changed = changed[:limit] + [f"{len(changed) - limit} more changed"]
    return ", ".join(parts + changed)


def _short(value, limit: int = 160) -> str:
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    except (TypeError, ValueError, RecursionError):
        text = "(unreadable stored value)"
    return text if len(text) <= limit else text[: limit - 3] + "..."
