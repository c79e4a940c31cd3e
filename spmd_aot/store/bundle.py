"""Bundles: a tar of some artifacts (refs, manifests, part blobs) to carry between caches
where no shared storage reaches (an air-gapped cluster, a CI artifact, an attachment).

Format (a plain POSIX tar; ``.tar.gz``/``.tgz``/``.tar.xz`` names are compressed)::

    index.json                     {"format": "spmd-aot-bundle", "version": 1,
                                    "refs": {key: manifest digest}, "blobs": {digest: size}}
    objects/<64 hex sha256>        one member per blob, named by the sha256 of its bytes

``import_bundle`` never extracts anything to the filesystem: it streams each member's bytes
into the store, which names them by their hash. Before writing anything it checks that every
member is a plain regular file (no links, devices or sparse members) named exactly
``index.json`` (the first member) or ``objects/<64 hex>`` (absolute paths and ``..`` are
refused) and no larger than any blob a load reads (``LoadLimits``; the index 16 MiB), each
header as it is met, before its data; that every blob hashes to its name, that the index lists
exactly the blobs present, and that every ref names a manifest of that key whose parts are all
in the bundle. A bundle that fails any check is refused as a whole. Members are hashed and
stored in chunks, never read whole (only the index and manifests are, within their limits), in
two forward passes over the file whatever the members' order, so an import costs time linear
in the bundle's size, compressed or not. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import re
import secrets
import stat
import tarfile
from collections.abc import Iterator

from ..format import bounded
from ..errors import CorruptArtifactError, SpmdAotError
from ..format.limits import load_limits
from .names import DIGEST_PATTERN, check_key, is_digest
from .protocol import local_files
from .transfer import artifact_blobs, largest_blob, manifest_key, manifest_parts

__all__ = ["export_bundle", "import_bundle", "BundleError", "BundleSummary", "INDEX_NAME"]

INDEX_NAME = "index.json"
FORMAT = "spmd-aot-bundle"
VERSION = 1
_OBJECT_RE = re.compile(rf"objects/({DIGEST_PATTERN})")
_CHUNK = 1 << 20
_INDEX_MAX = 16 << 20
_MAX_MEMBERS = 1 << 17
_PLAIN = (tarfile.REGTYPE, tarfile.AREGTYPE)


class BundleError(CorruptArtifactError):
    """A bundle is malformed, tampered with, or tries to write outside the store."""


@dataclasses.dataclass
class BundleSummary:
    path: str
    refs: dict[str, str]  # key -> manifest digest
    blobs: int
    bytes: int
    written: int = 0  # import: blobs the store did not already hold


def _write_mode(path: pathlib.Path) -> str:
    name = path.name.lower()
    if name.endswith((".tar.gz", ".tgz")):
        return "w:gz"
    if name.endswith((".tar.xz", ".txz")):
        return "w:xz"
    if name.endswith((".tar.bz2", ".tbz2")):
        return "w:bz2"
    return "w"


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0  # reproducible: same artifacts, same bytes
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def export_bundle(store, refs: dict[str, str], out: str | os.PathLike) -> BundleSummary:
    """Write the artifacts ``refs`` (key -> manifest digest) of ``store`` to the tar ``out``.

    Every blob is read through ``store.get`` (re-hashed), one at a time: twice, once for the
    index's sizes and once into the tar, so memory holds one blob, never the whole bundle. The
    file appears complete or not at all (written beside ``out``, then renamed).
    """
    if not refs:
        raise SpmdAotError("nothing to export: name at least one artifact")
    blobs: dict[str, None] = {}
    for key, digest in sorted(refs.items()):
        manifest = store.get(digest, limit=load_limits().part_bytes)
        if manifest_key(manifest, f"manifest {digest}") != key:
            raise CorruptArtifactError(f"ref {key} points to manifest {digest}, which belongs to another key")
        for d in artifact_blobs(store, digest).values():
            blobs[d] = None
    out = pathlib.Path(out)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(6)}.tmp")
    total = 0
    sizes = {}
    try:
        for d in sorted(blobs):
            sizes[d] = len(store.get(d, limit=largest_blob()))
        with tarfile.open(tmp, _write_mode(out), format=tarfile.PAX_FORMAT) as tar:
            index = json.dumps({"format": FORMAT, "version": VERSION, "refs": dict(sorted(refs.items())),
                                "blobs": sizes}, indent=1, sort_keys=True).encode()
            tar.addfile(_member(INDEX_NAME, len(index)), io.BytesIO(index))
            for d in sorted(blobs):
                data = store.get(d, limit=sizes[d])  # re-hashed: the same bytes as measured
                tar.addfile(_member(f"objects/{d}", len(data)), io.BytesIO(data))
                total += len(data)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return BundleSummary(str(out), dict(sorted(refs.items())), len(sizes), total)


def _check_member(member: tarfile.TarInfo, path) -> str | None:
    """The digest a member holds (None for the index); ``BundleError`` for anything else."""
    name = member.name
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or ".." in parts:
        raise BundleError(f"bundle {path}: member {name!r} is a path traversal (absolute or with "
                          "'..'); refusing the bundle")
    if member.issym() or member.islnk():
        raise BundleError(f"bundle {path}: member {name!r} is a link (to {member.linkname!r}); "
                          "refusing the bundle")
    if member.type not in _PLAIN or member.sparse is not None:
        raise BundleError(f"bundle {path}: member {name!r} is not a plain regular file (a device, "
                          "directory, sparse or multi-volume member); refusing the bundle")
    limit = _INDEX_MAX if name == INDEX_NAME else largest_blob()
    if member.size > limit:
        raise BundleError(f"bundle {path}: member {name!r} is {member.size} bytes, more than the {limit} "
                          "any load reads; refusing the bundle (SPMD_AOT_LOAD_LIMITS raises the limit)")
    if name == INDEX_NAME:
        return None
    m = _OBJECT_RE.fullmatch(name)
    if m is None:
        raise BundleError(f"bundle {path}: unexpected member {name!r}; a bundle holds only "
                          f"{INDEX_NAME} and objects/<sha256>")
    return m.group(1)


def _open_member(tar: tarfile.TarFile, member: tarfile.TarInfo):
    f = tar.extractfile(member)
    if f is None:
        raise BundleError(f"member {member.name!r} has no content")
    return f


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes:
    """A small member's bytes (the index, a manifest), never more than ``limit`` of them."""
    if member.size > limit:
        raise BundleError(f"member {member.name!r} is {member.size} bytes, more than the {limit} allowed")
    with _open_member(tar, member) as f:
        return f.read(limit)


def _open_stream(path: pathlib.Path):
    """The bundle file, opened for one forward pass: a regular file (a FIFO or device is refused
    at once, never waited on), read by the caller in archive order (``_stream``)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise BundleError(f"cannot read bundle {path}: {exc}") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise BundleError(f"bundle {path} is not a regular file")
    return f


@contextlib.contextmanager
def _stream(path: pathlib.Path) -> Iterator[Iterator[tuple[tarfile.TarFile, tarfile.TarInfo, str | None]]]:
    """One pass over the bundle in archive order: (tar, member, its digest or None for the
    index), each header checked (``_check_member``) before its data is read.

    The tar is opened as a stream (``r|*``): it can only move forward, so a compressed bundle is
    decompressed once per pass whatever its members' order (a seekable ``.tar.gz`` re-decompresses
    from the start for every backwards seek: 1,200 members read in digest order took minutes)."""
    with _open_stream(path) as f:
        try:
            tar = tarfile.open(fileobj=f, mode="r|*")
        except (OSError, tarfile.TarError) as exc:
            raise BundleError(f"cannot read bundle {path}: {exc}") from None

        def members():
            count = 0
            while True:
                try:
                    member = tar.next()
                except (OSError, EOFError, tarfile.TarError) as exc:
                    raise BundleError(f"bundle {path} is damaged: {exc}") from None
                if member is None:
                    return
                count += 1
                if count > _MAX_MEMBERS:
                    raise BundleError(f"bundle {path} has more than {_MAX_MEMBERS} members; refusing it")
                yield tar, member, _check_member(member, path)

        with tar:
            yield members()


def _load_index(raw: bytes, path) -> tuple[dict[str, str], dict[str, int]]:
    try:
        index = bounded.load_json(raw, f"bundle {path}: {INDEX_NAME}", max_bytes=_INDEX_MAX,
                                  objects=2 * _MAX_MEMBERS + 16)
    except CorruptArtifactError as exc:
        raise BundleError(str(exc)) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise BundleError(f"bundle {path}: {INDEX_NAME} is not an spmd-aot bundle index")
    if index.get("version") != VERSION:
        raise BundleError(f"bundle {path}: version {index.get('version')!r}, this spmd-aot reads {VERSION}")
    refs, blobs = index.get("refs"), index.get("blobs")
    if not isinstance(refs, dict) or not isinstance(blobs, dict):
        raise BundleError(f"bundle {path}: {INDEX_NAME} lacks 'refs' or 'blobs'")
    for key, digest in refs.items():
        try:
            check_key(key)
        except SpmdAotError as exc:
            raise BundleError(f"bundle {path}: {exc}") from None
        if not is_digest(digest):
            raise BundleError(f"bundle {path}: ref {key!r} names invalid digest {str(digest)[:80]!r}")
    for digest, size in blobs.items():
        if not is_digest(digest) or not isinstance(size, int):
            raise BundleError(f"bundle {path}: bad blob entry {str(digest)[:80]!r}: {size!r}")
    return refs, blobs


def import_bundle(store, path: str | os.PathLike) -> BundleSummary:
    """Check the whole bundle (see the module docstring), then store its blobs and refs.
    Returns what was imported.

    Two forward passes over the file (``_stream``), so the work is linear in its size, even
    compressed: the first checks everything and writes nothing; the second streams every blob
    into the store in archive order, then sets the refs. Readers reach an artifact only through
    its ref, so no reader sees a manifest before all its parts are stored."""
    path = pathlib.Path(path)
    refs, sizes, manifests = _check_bundle(path)
    # ---- pass 2: every blob in archive order, re-hashed on the way in, then the refs; under the
    # build locks of the keys (every writer holds its key's lock: gc relies on it)
    written = total = 0
    seen: set[str] = set()
    with contextlib.ExitStack() as locks:
        for key in sorted(refs):
            locks.enter_context(store.lock(key))
        local = local_files(store)
        with _stream(path) as members:
            for tar, member, digest in members:
                if digest is None:
                    continue
                if sizes.get(digest) != member.size or digest in seen:
                    raise BundleError(f"bundle {path} changed while importing (member objects/{digest})")
                seen.add(digest)
                had = store.has(digest)
                if local is store:  # streamed: a blob is never held in memory whole
                    with _open_member(tar, member) as f:
                        try:
                            store.put_stream(f, digest)
                        except CorruptArtifactError:
                            raise BundleError(f"bundle {path}: member objects/{digest} changed while "
                                              "importing") from None
                elif store.put(_read_member(tar, member, largest_blob())) != digest:
                    raise BundleError(f"bundle {path}: member objects/{digest} changed while importing")
                written += not had
                total += member.size
        if seen != set(sizes):
            raise BundleError(f"bundle {path} changed while importing: blobs are missing from it now")
        for key, digest in sorted(refs.items()):
            store.set_ref(key, digest)
    return BundleSummary(str(path), dict(sorted(refs.items())), len(sizes), total, written)


def _check_bundle(path: pathlib.Path) -> tuple[dict[str, str], dict[str, int], dict[str, set[str]]]:
    """Pass 1, writing nothing: (refs, digest -> size of every blob, manifest digest -> its
    parts), or ``BundleError``. The index must come first (``export_bundle`` writes it first), so
    manifests are known when met and checked from the bytes that are hashed."""
    refs: dict[str, str] | None = None
    listed: dict[str, int] = {}
    sizes: dict[str, int] = {}
    manifests: dict[str, set[str]] = {}
    with _stream(path) as members:
        for tar, member, digest in members:
            if digest is None:
                if refs is not None:
                    raise BundleError(f"bundle {path}: two {INDEX_NAME} members")
                if sizes:
                    raise BundleError(f"bundle {path}: {INDEX_NAME} is not its first member (spmd-aot "
                                      "export writes it first); refusing the bundle")
                refs, listed = _load_index(_read_member(tar, member, _INDEX_MAX), path)
                wanted = {d: sorted(k for k, v in refs.items() if v == d) for d in refs.values()}
                continue
            if refs is None:
                raise BundleError(f"bundle {path}: its first member is {member.name!r}, not {INDEX_NAME} "
                                  "(spmd-aot export writes the index first); refusing the bundle")
            if digest in sizes:
                raise BundleError(f"bundle {path}: blob {digest} appears twice")
            if digest not in listed:
                raise BundleError(f"bundle {path}: the index does not match the blobs present "
                                  f"(unlisted: {digest})")
            h = hashlib.sha256()
            if digest in wanted:  # a manifest: read whole (within its limit), hashed from those bytes
                data = _read_member(tar, member, load_limits().part_bytes)
                h.update(data)
            else:
                with _open_member(tar, member) as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
            if h.hexdigest() != digest:
                raise BundleError(f"bundle {path}: member objects/{digest} is tampered with or damaged: "
                                  f"its content hashes to {h.hexdigest()}; refusing the bundle")
            if digest in wanted:
                for key in wanted[digest]:
                    where = f"bundle {path}: manifest {digest} (ref {key})"
                    if manifest_key(data, where) != key:
                        raise BundleError(f"{where} is the manifest of another key; refusing the bundle")
                manifests[digest] = set(manifest_parts(data, where).values())
            sizes[digest] = member.size
    if refs is None:
        raise BundleError(f"bundle {path} has no {INDEX_NAME}: not an spmd-aot bundle")
    if set(listed) != set(sizes):
        extra, missing = sorted(set(sizes) - set(listed)), sorted(set(listed) - set(sizes))
        raise BundleError(f"bundle {path}: the index does not match the blobs present "
                          f"(unlisted: {extra[:3]}, missing: {missing[:3]})")
    for key, digest in refs.items():
        if digest not in manifests:
            raise BundleError(f"bundle {path}: ref {key} names manifest {digest}, which is not in it")
        missing = sorted(manifests[digest] - set(sizes))
        if missing:
            raise BundleError(f"bundle {path}: manifest {digest} (ref {key}) names blobs the bundle lacks: "
                              f"{', '.join(missing[:3])}")
    return refs, sizes, manifests
