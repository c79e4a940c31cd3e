"""Time what a cache's content (or another user) can make spmd-aot do, outside the graph check.

    PYTHONPATH=. python tools/stress/worst_case_cache.py bundle  [--blobs 1200] [--size 65536]
    PYTHONPATH=. python tools/stress/worst_case_cache.py explain [--refs 1000]
    PYTHONPATH=. python tools/stress/worst_case_cache.py lease          (as root: needs a second uid)

* ``bundle``: import a gzip bundle of ``--blobs`` random blobs written in an order unlike
  their digests' (a reader that seeks back re-decompresses the stream from its start).
* ``explain``: explain a miss in a cache holding the small MLP job's entry plus, in turn, 40 refs
  to one 255 MiB blob, ``--refs`` refs to distinct manifests, and 20 refs to distinct 3.7 MiB
  manifests (dense msgpack, the costliest to decode).
* ``lease``: build the MLP job (world 1), let uid 65534 open the entry's lease file read-only and
  hold an exclusive ``flock`` on it, then time the owner's next job start (a hit).

The graph check's worst cases: ``tools/stress/worst_case_load.py``.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import io
import json
import os
import pathlib
import random
import shutil
import sys
import tarfile
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def bundle(args) -> None:
    from spmd_aot.store import LocalStore
    from spmd_aot.store.bundle import import_bundle

    with tempfile.TemporaryDirectory(prefix="spmd-aot-bundle-") as tmp:
        path = pathlib.Path(tmp) / "many.tar.gz"
        rng = random.Random(0)
        blobs = [rng.randbytes(args.size) for _ in range(args.blobs)]
        digests = [hashlib.sha256(b).hexdigest() for b in blobs]
        index = json.dumps({"format": "spmd-aot-bundle", "version": 1, "refs": {},
                            "blobs": {d: args.size for d in digests}}).encode()
        order = list(range(args.blobs))
        rng.shuffle(order)
        with tarfile.open(path, "w:gz", compresslevel=1) as tar:
            for name, data in [("index.json", index)] + [(f"objects/{digests[i]}", blobs[i]) for i in order]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        start = time.perf_counter()
        summary = import_bundle(LocalStore(pathlib.Path(tmp) / "cache"), path)
        print(f"bundle: {summary.blobs} blobs ({path.stat().st_size >> 20} MiB gzip) imported in "
              f"{time.perf_counter() - start:.1f} s")


def explain(args) -> None:
    from support.jobs import build_unsigned
    from spmd_aot.entries import read_manifest
    from spmd_aot.format.artifact import pack_manifest
    from spmd_aot.keying.explain import explain_miss
    from spmd_aot.keying.key import CacheKey
    from spmd_aot.store import LocalStore

    with tempfile.TemporaryDirectory(prefix="spmd-aot-explain-") as tmp:
        source = build_unsigned(pathlib.Path(tmp) / "source")
        manifest = read_manifest(LocalStore(pathlib.Path(tmp) / "source"), source.digest)
        raw = LocalStore(pathlib.Path(tmp) / "source").get(source.digest)
        live = CacheKey("0" * 64, {n: "f" * 64 for n in manifest["ingredients"]},
                        {n: {"live": 1} for n in manifest["ingredients"]})

        def fresh(name):
            store = LocalStore(pathlib.Path(tmp) / name)
            store.set_ref("built", store.put(raw))
            return store

        def big(store):
            blob = store.put(os.urandom(255 << 20))
            for i in range(40):
                store.set_ref(f"big-{i:02d}", blob)
            return "40 refs to one 255 MiB blob"

        def many(store):
            for i in range(args.refs):
                store.set_ref(f"k{i:05d}", store.put(pack_manifest(
                    dict(manifest, stats=dict(manifest["stats"], trace_seconds=i)))))
            return f"{args.refs} refs to distinct manifests"

        def fat(store):
            for i in range(20):
                values = dict(manifest["ingredient_values"], pad=[{"a": j} for j in range(i, i + 480_000)])
                store.set_ref(f"f{i:02d}", store.put(pack_manifest(dict(manifest, ingredient_values=values))))
            return f"20 refs to distinct {store.size(store.get_ref('f00')) / (1 << 20):.1f} MiB manifests"

        for fill in (big, many, fat):
            store = fresh(fill.__name__)
            what = fill(store)
            start = time.perf_counter()
            text = explain_miss(store, live)
            print(f"explain, {what}: {time.perf_counter() - start:.2f} s ({text[-60:]!r})", flush=True)


def lease(args) -> None:
    import fcntl

    from support.jobs import compiled_run
    from spmd_aot.store import LocalStore

    if os.geteuid() != 0:
        sys.exit("lease: run as root (the other user is uid 65534, reached with setuid)")
    base = tempfile.mkdtemp(prefix="spmd-aot-lease-", dir="/tmp")
    os.chmod(base, 0o755)
    cache = os.path.join(base, "cache")
    *_, info = compiled_run("mlp", "sgd", 0, 1, 1, cache)
    os.chmod(cache, 0o755)  # readable by others, as a cache other users' jobs load from
    store = LocalStore(cache)
    path = str(store.root / "leases" / f"{store.get_ref(info.key)}.lock")
    print(f"lease: lease file mode {os.stat(path).st_mode & 0o777:04o}")
    result_r, result_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user: system calls only, then _exit
        os.close(stop_w)
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(result_w, b"holds it exclusively")
        except OSError as exc:
            os.write(result_w, f"cannot: {errno.errorcode.get(exc.errno, exc.errno)}".encode())
        os.read(stop_r, 1)
        os._exit(0)
    os.close(stop_r)
    print(f"lease: uid 65534 {os.read(result_r, 100).decode()}", flush=True)
    start = time.monotonic()
    try:
        *_, info = compiled_run("mlp", "sgd", 0, 1, 1, cache)
        print(f"lease: the owner's next job start: hit={info.hit} in {time.monotonic() - start:.1f} s")
    except Exception as exc:
        print(f"lease: the owner's next job start failed after {time.monotonic() - start:.1f} s: "
              f"{type(exc).__name__}: {str(exc)[:120]}")
    finally:
        os.close(stop_w)
        os.waitpid(pid, 0)
        shutil.rmtree(base, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="case", required=True)
    p = sub.add_parser("bundle")
    p.add_argument("--blobs", type=int, default=1200)
    p.add_argument("--size", type=int, default=65536)
    p.set_defaults(func=bundle)
    p = sub.add_parser("explain")
    p.add_argument("--refs", type=int, default=1000)
    p.set_defaults(func=explain)
    sub.add_parser("lease").set_defaults(func=lease)
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
