"""Generates the reference tables of the documentation from the code, so they cannot drift from it.

Each generated block of a page sits between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``; the
text around it is written by hand. The blocks come from:

* ``cli-*``: spotrun's own flags from their table (``elastic.options``), torchrun's from the parser
  (``elastic.cli.build_parser``, which *is* the installed torch's torchrun parser plus spotrun's flags), and the
  tools' parsers (``spotrun status``, ``spotrun report``, ``spotrun-ckpt``, ``spotrun-chaos``, ``python -m
  elastic.etcd_server``): every option string, its environment variable, its effective default and its help;
* ``env``: the variables of ``elastic.options`` and every other module-level ``SPOTRUN_*`` constant of
  ``elastic`` and ``checkpoint`` with its ``#:`` comment or docstring;
* ``rdzv-conf``: the fields of ``EtcdRendezvousConfig`` (defaults and field docstrings), its aliases and the
  torch keys it accepts and ignores;
* ``events``, ``failure-causes``, ``recovery-causes``: the ``RecoveryEvent``, ``FailureCause`` and
  ``RecoveryCause`` enums of ``elastic.api`` with their docstrings;
* ``ckpt-exit-codes``: ``checkpoint.cli.EXIT_CODES``.

Usage (from the repository root, in the project's venv)::

    python docs/gen_reference.py            # rewrite the blocks in docs/
    python docs/gen_reference.py --check    # exit 1 naming every stale block (CI, tests/docs)

The output depends on the installed torch (torchrun's flags): the committed pages are generated with the
suite's torch (2.13.0). Environment variables that change argparse defaults (``PET_*``, ``SPOTRUN_*``) are
removed before any parser is built, so the defaults shown are the built-in ones.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(<!-- generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.S)


def _clean_environment() -> None:
    for name in list(os.environ):
        if name.startswith(("PET_", "SPOTRUN_", "TORCHELASTIC_")):
            del os.environ[name]


# --- helpers ---------------------------------------------------------------------------------------------------


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


def cell(text: object) -> str:
    """One markdown table cell: one line; reST ````literals```` become code spans; outside them ``|``, ``<``,
    ``>``, ``*`` and ``\\`` are escaped (inside a code span only ``|``, which would end the cell)."""
    s = re.sub(r"``(.+?)``", r"`\1`", " ".join(str(text).split()))
    parts = re.split(r"(`[^`]+`)", s)
    return "".join(p.replace("|", "\\|") if p.startswith("`") else _escape(p) for p in parts)


def code(text: object) -> str:
    s = str(text)
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --- command lines ---------------------------------------------------------------------------------------------


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    try:
        return parser._get_formatter()._expand_help(action)  # argparse's own %(default)s expansion
    except (KeyError, TypeError, ValueError):
        return action.help


def _torch_env(action: argparse.Action) -> str | None:
    from torch.distributed.argparse_util import check_env, env

    return f"PET_{action.dest.upper()}" if isinstance(action, (env, check_env)) else None


def _default(action: argparse.Action) -> str:
    value = action.default
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or action.nargs == 0:
        return "on" if value else "off"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if value else "off"
    if value is None or value == "" or value == []:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return code(f"{value:g}" if isinstance(value, float) else value)
    return code(value) if len(str(value)) < 40 and "adaptive" not in str(value) else cell(value)


def _options(action: argparse.Action) -> str:
    if not action.option_strings:
        name = action.metavar or action.dest
        return code(name if action.nargs != argparse.REMAINDER else f"-- {name}...")
    # Every spelling (torchrun's underscores, short forms, --no-); whether it takes a value shows in the default
    # column (on/off for switches).
    return "<br>".join(map(code, action.option_strings))


def parser_table(parser: argparse.ArgumentParser, *, env: Callable[[argparse.Action], str | None] | None = None,
                 actions: list[argparse.Action] | None = None) -> str:
    rows = []
    for action in actions if actions is not None else parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction,
                                                                    argparse._SubParsersAction)):
            continue
        default = _default(action)
        row = [_options(action)]
        if env is not None:
            name = env(action)
            row.append(code(name) if name else "")
        row += [default, cell(_help(parser, action))]
        rows.append(row)
    header = ["flag"] + (["environment"] if env is not None else []) + ["default", "meaning"]
    return table(header, rows)


def spotrun_options_table() -> str:
    from elastic.options import OPTIONS

    rows = []
    for option in OPTIONS:
        shown = option.shown_default
        if shown is None:
            default = ""
        elif option.is_switch or option.default_text is not None:
            default = cell(shown)
        else:
            default = code(shown)
        rows.append(["<br>".join(map(code, option.option_strings)), code(option.env), default,
                     cell(option.help_text)])
    return table(["flag", "environment", "default", "meaning"], rows)


def cli_spotrun() -> str:
    from elastic.cli import build_parser
    from elastic.options import OPTIONS

    parser = build_parser()
    ours = {s for option in OPTIONS for s in option.option_strings}
    torch_actions = [a for a in parser._actions if not ours.intersection(a.option_strings)]
    import torch

    return (
        "#### spotrun-only flags\n\n"
        "Spelled in full only (no abbreviations), so a script's own `--hang` or `--preempt` reaches the script. "
        "The environment variable is read when the flag is not given.\n\n"
        + spotrun_options_table()
        + f"\n#### torchrun's flags (torch {torch.__version__.split('+')[0]})\n\n"
        "The parser is the installed torch's `get_args_parser()`: both spellings, defaults and `PET_*` "
        "fallbacks are torchrun's; only `--rdzv-backend` defaults to `etcd-v3`.\n\n"
        + parser_table(parser, env=_torch_env, actions=torch_actions)
    )


def cli_status() -> str:
    from elastic.status import build_parser

    return parser_table(build_parser())


def cli_report() -> str:
    from elastic.report import build_parser

    return parser_table(build_parser())


def cli_ckpt() -> str:
    from checkpoint.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = []
    for name, subparser in sub.choices.items():
        out.append(f"#### `spotrun-ckpt {name}`\n\n{cell(helps.get(name, ''))}\n\n" + parser_table(subparser))
    return "\n".join(out)


def cli_chaos() -> str:
    from elastic.chaos.cli import build_parser

    return parser_table(build_parser())


def cli_etcd_server() -> str:
    from elastic.etcd_server import build_parser

    return parser_table(build_parser())


# --- environment variables -------------------------------------------------------------------------------------


def _module_constants(path: Path) -> Iterator[tuple[str, str, str]]:
    """(constant name, value, documentation) of each module-level str constant of ``path`` whose value is a
    ``SPOTRUN_*`` name; the documentation is the ``#:`` comment above it or the string literal below it."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    body = tree.body
    for i, node in enumerate(body):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            target, value = node.target.id, node.value
        else:
            continue
        if not (isinstance(value, ast.Constant) and isinstance(value.value, str)
                and re.fullmatch(r"SPOTRUN_[A-Z0-9_]+", value.value)):
            continue
        doc: list[str] = []
        j = node.lineno - 2
        while j >= 0 and lines[j].lstrip().startswith("#:"):
            doc.insert(0, lines[j].lstrip()[2:].strip())
            j -= 1
        after = body[i + 1] if i + 1 < len(body) else None
        if not doc and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            doc = [after.value.value]
        if not doc:
            # constants grouped under one comment (the metadata URLs): the nearest #: above the group
            k = node.lineno - 2
            while k >= 0 and re.match(r"^[A-Z_]+ *(: *\w+ *)?= *\"SPOTRUN_", lines[k]):
                k -= 1
            if k >= 0 and lines[k].lstrip().startswith("#:"):
                doc = [lines[k].lstrip()[2:].strip()]
        yield target, value.value, " ".join(doc)


def env_variables() -> list[tuple[str, str, str]]:
    """(variable, module, documentation) of every option's variable and every other ``SPOTRUN_*`` constant,
    sorted by variable."""
    from elastic.options import OPTIONS

    found = [(option.env, "elastic.options", option.env_help) for option in OPTIONS]
    for package in ("elastic", "checkpoint"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for _, value, doc in _module_constants(path):
                found.append((value, module, doc))
    return sorted(set(found))


def _flag_of_env() -> dict[str, str]:
    from elastic.options import OPTIONS

    return {option.env: option.flag for option in OPTIONS}


def env() -> str:
    flags = _flag_of_env()
    rows = []
    for name, module, doc in env_variables():
        flag = flags.get(name)
        rows.append([code(name), code(flag) if flag else "", code(module), cell(doc)])
    return table(["variable", "flag", "defined in", "meaning"], rows)


# --- rendezvous configuration ----------------------------------------------------------------------------------


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a class, read from its source."""
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, [*body[1:], None], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = after.value.value
    return docs


def rdzv_conf() -> str:
    from elastic.rendezvous.api import IGNORED_TORCH_KEYS, KEY_ALIASES, EtcdRendezvousConfig

    docs = _field_docs(EtcdRendezvousConfig)
    accepted = set(EtcdRendezvousConfig.accepted_keys())
    rows = []
    for f in dataclasses.fields(EtcdRendezvousConfig):
        if f.name not in accepted:
            continue  # from the launcher's own flags (--rdzv-id, --rdzv-endpoint, --nnodes)
        default = "" if f.default is dataclasses.MISSING or f.default is None else code(
            str(f.default).lower() if isinstance(f.default, bool) else f"{f.default:g}"
            if isinstance(f.default, float) else f.default)
        rows.append([code(f.name), default, cell(docs.get(f.name, ""))])
    aliases = ", ".join(f"{code(a)} = {code(n)}" for a, n in sorted(KEY_ALIASES.items()))
    ignored = ", ".join(code(k) for k in sorted(IGNORED_TORCH_KEYS))
    return (table(["key", "default", "meaning"], rows)
            + f"\nAliases (torch's etcd-v2 spellings): {aliases}.\n\n"
            f"Accepted for compatibility with torchrun command lines, no effect: {ignored}.\n")


# --- events ----------------------------------------------------------------------------------------------------


def _enum_table(cls: type[enum.Enum], what: str) -> str:
    docs = _field_docs_enum(cls)
    rows = [[code(m.value), cell(docs.get(m.name, ""))] for m in cls]
    return table([what, "meaning"], rows)


def _field_docs_enum(cls: type) -> dict[str, str]:
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, [*body[1:], None], strict=False):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.targets[0].id] = after.value.value
    return docs


def events() -> str:
    from elastic.api import RecoveryEvent

    return _enum_table(RecoveryEvent, "event")


def failure_causes() -> str:
    from elastic.api import FailureCause

    return _enum_table(FailureCause, "cause")


def recovery_causes() -> str:
    from elastic.api import RecoveryCause

    return _enum_table(RecoveryCause, "recovery_cause")


def ckpt_exit_codes() -> str:
    from checkpoint.cli import EXIT_CODES

    rows = [["`0`", "success", ""], ["`2`", "usage (bad command line)", ""]]
    rows += [[code(c), cell((k.__doc__ or "").strip().splitlines()[0]), code(k.__name__)] for k, c in EXIT_CODES]
    rows.sort(key=lambda r: int(r[0].strip("`")))
    return table(["exit code", "meaning", "error class"], rows)


GENERATORS: dict[str, Callable[[], str]] = {
    "cli-spotrun": cli_spotrun,
    "cli-status": cli_status,
    "cli-report": cli_report,
    "cli-ckpt": cli_ckpt,
    "cli-chaos": cli_chaos,
    "cli-etcd-server": cli_etcd_server,
    "env": env,
    "rdzv-conf": rdzv_conf,
    "events": events,
    "failure-causes": failure_causes,
    "recovery-causes": recovery_causes,
    "ckpt-exit-codes": ckpt_exit_codes,
}


def render(text: str, cache: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in GENERATORS:
            raise SystemExit(f"unknown generated block {name!r}; known: {', '.join(GENERATORS)}")
        if name not in cache:
            cache[name] = GENERATORS[name]()
        return f"{match.group(1)}{cache[name]}{match.group(4)}"

    return BLOCK.sub(replace, text)


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if BLOCK.search(p.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 when a page is stale")
    args = parser.parse_args(argv)
    _clean_environment()
    sys.path.insert(0, str(ROOT))
    cache: dict[str, str] = {}
    stale = []
    for page in pages():
        old = page.read_text()
        new = render(old, cache)
        if new != old:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    unused = set(GENERATORS) - set(cache)
    if unused:
        print(f"error: generated blocks used by no page: {', '.join(sorted(unused))}", file=sys.stderr)
        return 1
    if args.check and stale:
        print("stale generated reference (run `python docs/gen_reference.py`): "
              + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    for page in stale:
        print(f"updated {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
