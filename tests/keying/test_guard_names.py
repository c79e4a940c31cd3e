"""A guarded file is named so that it finds itself again, also when its package is not on
``sys.path`` (an editable install finds it through an import hook): by the path its dotted module
name spells, not by its bare file name, which other loaded packages share (``models.py``)."""

from __future__ import annotations

import importlib.util
import sys
import types

from spmd_aot.keying import guards


def _load(name: str, path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_a_module_found_by_an_import_hook_is_named_by_its_dotted_name(tmp_path, monkeypatch):
    hooked = tmp_path / "hooked" / "mypkg"  # not on sys.path: as under an editable install
    hooked.mkdir(parents=True)
    (hooked / "__init__.py").write_text("")
    (hooked / "models.py").write_text("SCALE = 2\n")
    other = tmp_path / "site" / "otherpkg"  # on sys.path, with a file of the same name
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "models.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in ("mypkg", "mypkg.models", "otherpkg", "otherpkg.models"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    _load("mypkg", hooked / "__init__.py")
    mine = _load("mypkg.models", hooked / "models.py")
    import otherpkg.models  # noqa: F401

    rel = guards.relative_name(mine.__file__)
    assert rel == "mypkg/models.py"
    assert guards._locate(rel) == [str(hooked / "models.py")]
    # the file on sys.path keeps its sys.path-relative name
    assert guards.relative_name(str(other / "models.py")) == "otherpkg/models.py"


def test_a_script_is_not_confused_with_a_library_module_of_the_same_file_name(tmp_path, monkeypatch):
    """A training script ``probe.py`` at a sys.path root is guarded as ``probe.py``; a loaded
    library module ``libpkg/sub/probe.py`` (urllib3 ships ``urllib3/http2/probe.py``) ends with
    the same name but is another file: it must not stand for the script (every rank then saw
    "changed since the entry was traced" and refused the entry)."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "probe.py").write_text("STEP = 1\n")
    lib = tmp_path / "site" / "libpkg" / "sub"
    lib.mkdir(parents=True)
    for d in (lib.parent, lib):
        (d / "__init__.py").write_text("")
    (lib / "probe.py").write_text("OTHER = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(scripts))
    for name in ("__probe_main__", "libpkg", "libpkg.sub", "libpkg.sub.probe"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    _load("__probe_main__", scripts / "probe.py")  # run as a script: its module is not named ``probe``
    import libpkg.sub.probe  # noqa: F401

    assert guards.relative_name(str(scripts / "probe.py")) == "probe.py"
    assert guards._locate("probe.py") == [str(scripts / "probe.py")]
