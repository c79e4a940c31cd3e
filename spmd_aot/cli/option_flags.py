"""The command line's options, generated from the fields of ``spmd_aot.options``.

Each options field carries its ``Flag`` (flag, argument group, parse and print functions) and its
documentation, whose first sentence is the ``--help`` line; this module turns them into argparse
arguments in named groups and turns parsed arguments back into ``ParallelOptions`` and
``RunOptions``. Nothing here names an option: a field added to ``options.py`` appears in every
command its ``Flag.commands`` lists.
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from ..errors import SpmdAotError
from ..options import ParallelOptions, RunOptions

__all__ = [
    "OPTION_CLASSES",
    "add_option_flags",
    "check_read",
    "first_sentence",
    "flag_fields",
    "given",
    "parallel_from_args",
    "reference_table",
    "run_from_args",
    "write_reference",
]

#: The classes whose fields are command-line options, in ``--help`` order.
OPTION_CLASSES = (ParallelOptions, RunOptions)


def first_sentence(doc: str) -> str:
    """The first sentence of an option's documentation: its ``--help`` line."""
    match = re.match(r"(.+?(?<!e\.g)(?<!i\.e)[.!?])(?=\s|$)", doc, re.DOTALL)
    return match.group(1) if match else doc


def flag_fields(command: str) -> list[dataclasses.Field]:
    """The option fields ``command`` takes on the command line, in ``--help`` order."""
    return [f for cls in OPTION_CLASSES for f in dataclasses.fields(cls)
            if f.metadata["flag"] is not None
            and (command in f.metadata["flag"].commands or "*" in f.metadata["flag"].commands)]


def add_option_flags(p: argparse.ArgumentParser, command: str, *, groups: dict | None = None,
                     matrix: tuple[str, ...] = (), common: bool = False) -> dict:
    """Add ``command``'s options to ``p``, each in the argument group its ``Flag`` names
    (``groups`` holds groups already made, by title; returned with the new ones).
    ``matrix``: fields that take several values, one configuration each (``build -p``).
    ``common``: the options every command takes (``Flag.commands`` ``"*"``), which a parent
    parser gives each command; else ``command``'s own."""
    groups = {} if groups is None else groups
    for f in flag_fields(command):
        flag = f.metadata["flag"]
        if common != ("*" in flag.commands):
            continue
        group = groups.get(flag.group)
        if group is None:
            group = groups[flag.group] = p.add_argument_group(flag.group)
        names = [flag.short, flag.flag] if flag.short else [flag.flag]
        kwargs = {"dest": f.name, "help": _help(f, matrix)}
        if flag.kind == "switch":
            kwargs.update(action="store_true")
        else:
            kwargs.update(metavar=flag.metavar or f.name.upper(), default=None,
                          action="append" if flag.kind == "repeat" or f.name in matrix else "store")
            if flag.choices is not None:
                kwargs["choices"] = flag.choices
            if flag.parse is not None:
                kwargs["type"] = _argparse_type(flag.parse)
        group.add_argument(*names, **kwargs)
    return groups


def _help(field: dataclasses.Field, matrix) -> str:
    """The field's first sentence (or its flag's own line), how often it may be given, its default."""
    flag = field.metadata["flag"]
    text = flag.help or first_sentence(field.metadata["doc"])
    if flag.kind == "repeat" or field.name in matrix:
        text += " Repeat for several."
    if flag.kind == "value" and field.default is not None:
        text += f" Default: {flag.text(field.default)}."
    return text.replace("%", "%%")


def _argparse_type(parse):
    """``parse`` with its ValueError shown to the user as argparse shows a bad value."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__.lstrip("_")
    return convert


def given(args: argparse.Namespace, cls, *, skip: tuple[str, ...] = ()) -> dict:
    """The fields of ``cls`` the command line set, as field values (unset ones are left out)."""
    values = {}
    for f in dataclasses.fields(cls):
        flag = f.metadata["flag"]
        if flag is None or f.name in skip or not hasattr(args, f.name):
            continue
        raw = getattr(args, f.name)
        if flag.kind == "switch":
            if raw:
                values[f.name] = flag.switched
        elif raw is not None:
            try:
                values[f.name] = flag.collect(raw) if flag.kind == "repeat" else raw
            except ValueError as exc:
                raise SpmdAotError(str(exc)) from None
    return values


def parallel_from_args(args: argparse.Namespace, placement: str | None = None) -> ParallelOptions:
    """The ``ParallelOptions`` a parsed command line gives; ``placement``: one of a build's
    placements, with only the options that placement reads (``ParallelOptions.for_placement``)."""
    if placement is None:
        return ParallelOptions(**given(args, ParallelOptions))
    return ParallelOptions.for_placement(placement, **given(args, ParallelOptions, skip=("placement",)))


def check_read(args: argparse.Namespace, placements) -> None:
    """Refuse an option that none of ``placements`` reads (``--mesh-shape`` for 'replicate' alone):
    building without it would store something else than the command line says."""
    fields = given(args, ParallelOptions, skip=("placement",))
    read = set().union(*(ParallelOptions.read_by(p, fields) for p in placements))
    flags = {f.name: f.metadata["flag"] for f in dataclasses.fields(ParallelOptions)}
    for name in sorted(set(fields) - read, key=list(flags).index):
        flag = flags[name]
        also = " (or with another axis, e.g. --tp-plan)" if flag.with_axes else ""
        raise SpmdAotError(
            f"{flag.flag} applies to placement {' or '.join(map(repr, flag.placements))}{also} only, and this "
            f"command's placement is {' and '.join(map(repr, placements))}: add -p {flag.placements[0]} or drop "
            f"{flag.flag}")


def run_from_args(args: argparse.Namespace) -> RunOptions:
    """The ``RunOptions`` a parsed command line gives."""
    return RunOptions(**given(args, RunOptions))


def reference_table() -> str:
    """The options reference of ``docs/options.md``: one table per options class, one row per
    field (name, command-line form, default, documentation), generated so that a test can check
    the document against the fields."""
    out = []
    for cls in OPTION_CLASSES:
        out += [f"### `{cls.__name__}`", "", "| field | command line | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            flag = f.metadata["flag"]
            if flag is None:
                line = f"API only: {f.metadata['api_only']}"
            else:
                line = ", ".join(f"`{n}`" for n in (flag.short, flag.flag) if n)
                if flag.kind != "switch":
                    line += f" `{flag.metavar or f.name.upper()}`"
                line += " (repeatable)" if flag.kind == "repeat" else ""
                line += f" (sets {flag.switched!r})" if flag.kind == "switch" and flag.switched is not True else ""
                line += "" if "*" not in flag.commands else " (every command)"
            out.append(f"| `{f.name}` | {line} | `{f.default!r}` | {f.metadata['doc'].replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


#: The lines around the generated table in ``docs/options.md``.
TABLE_BEGIN = "<!-- options reference: generated by `python -m spmd_aot.cli.option_flags docs/options.md` -->"
TABLE_END = "<!-- end of options reference -->"


def write_reference(path) -> bool:
    """Replace the generated table in the document at ``path``; True when it changed."""
    import pathlib

    path = pathlib.Path(path)
    text = path.read_text()
    head, sep, rest = text.partition(TABLE_BEGIN)
    _, sep_end, tail = rest.partition(TABLE_END)
    if not sep or not sep_end:
        raise SystemExit(f"{path} has no lines {TABLE_BEGIN!r} ... {TABLE_END!r} around its options table")
    new = f"{head}{TABLE_BEGIN}\n\n{reference_table()}\n{TABLE_END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or ["docs/options.md"]:
        print(f"{name}: {'updated' if write_reference(name) else 'up to date'}")
