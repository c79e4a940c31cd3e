"""Which local cache directories spmd-aot uses without a signing key: the one rule.

Without ``SPMD_AOT_SIGNING_KEY`` nothing proves who wrote an entry, so an entry is only as
trustworthy as the directory's write permissions. Like ssh's StrictModes, a cache is used only
when nobody but the current user (and root) can add, replace or remove its entries:

* the cache root and every directory below it that spmd-aot walks (``objects/``, ``objects/ab/``,
  ``refs/``, ``used/``, ...) is owned by the current user or root and has no group or other
  write bit;
* every ancestor of the root is owned by the current user or root, and is either not group- or
  other-writable or has the sticky bit (``/tmp``: others cannot rename what they do not own).

Ownership and modes are what the filesystem reports: on NFS that is after uid mapping and
root squashing, and a POSIX ACL granting write shows as the group write bit (its mask).
Files need no check: blobs are re-hashed on every read, and a ref can only name a manifest
already in the cache, which records its own key.

A signing key lifts the rule (every manifest must then carry a valid HMAC), and so does an
explicit opt-in, for a cache shared with people you trust: ``SPMD_AOT_TRUST_CACHE=1``, the
CLI's ``--trust-cache``, or ``trust_cache=True`` of ``LocalStore`` / ``open_store``. Refusals
are ``UntrustedCacheError`` naming the directory, what is wrong and these three ways out.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import stat

from ..errors import SpmdAotError
from ..format.signing import ENV_SIGNING_KEY, signing_key

__all__ = ["ENV_TRUST_CACHE", "UntrustedCacheError", "Policy", "policy_for", "opted_in"]

#: Environment variable that opts in to using a cache others can write (``1``, ``true``, ``yes``).
ENV_TRUST_CACHE = "SPMD_AOT_TRUST_CACHE"


class UntrustedCacheError(SpmdAotError):
    """The cache directory is writable by other users and no signing key is set."""


def opted_in(trust_cache: bool | None = None) -> bool:
    """``trust_cache`` if given, else whether ``$SPMD_AOT_TRUST_CACHE`` says yes."""
    if trust_cache is not None:
        return bool(trust_cache)
    return os.environ.get(ENV_TRUST_CACHE, "").strip().lower() in ("1", "true", "yes")


@dataclasses.dataclass(frozen=True)
class Policy:
    """The rule above for the user ``uid``."""

    uid: int

    def check_dir(self, st: os.stat_result, path, ancestor: bool = False) -> None:
        """Raise ``UntrustedCacheError`` unless ``st`` (of directory ``path``) passes the rule."""
        why = None
        if st.st_uid not in (self.uid, 0):
            why = f"it is owned by uid {st.st_uid}, not by you (uid {self.uid}) or root"
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (ancestor and st.st_mode & stat.S_ISVTX):
            who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH))
                               if st.st_mode & bit)
            why = f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
        if why is None:
            return
        what = "an ancestor of the cache directory" if ancestor else "in the cache directory"
        raise UntrustedCacheError(
            f"refusing the cache: {path} ({what}) could be changed by other users: {why}. Without "
            f"{ENV_SIGNING_KEY}, spmd-aot uses a cache only if nobody else can write it. Fix one of: "
            f"`chmod go-w {path}` (and make it yours); set {ENV_SIGNING_KEY} on builders and jobs "
            f"(only signed entries load); or, if you trust everyone who can write it, set "
            f"{ENV_TRUST_CACHE}=1 (CLI: --trust-cache; API: trust_cache=True).")

    def check_ancestors(self, root: pathlib.Path) -> None:
        """Every directory above ``root`` (already resolved: no links) passes as an ancestor."""
        for parent in root.parents:
            self.check_dir(os.lstat(parent), parent, ancestor=True)


def policy_for(trust_cache: bool | None = None) -> Policy | None:
    """The rule to enforce, or None when a signing key is set or the user opted in."""
    if signing_key() is not None or opted_in(trust_cache) or not hasattr(os, "getuid"):
        return None
    return Policy(os.getuid())
