"""Write configuration.md at build time from the config schema, so the reference cannot drift.

Walks `odmoe.config.OdmoeConfig` and its nested dataclasses with `dataclasses.fields`, then the
lab overlay's own sections (`LabConfig`'s fault, emulation): one table per section (model,
cluster, worker, ...), one row per key: its dotted name, type, the schema's default,
the default `odmoe-launch` starts with when conf/ sets another (conf/config.yaml's default group
options), and its meaning. The meaning is the comment on the field's line, else the comment lines
just above it in the class's source; a field with neither gets the class docstring's mention of it,
else the comment on its line in the default group's YAML file, or nothing.
"""

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from pathlib import Path

import mkdocs_gen_files
import yaml

from odmoe.config import LabConfig, OdmoeConfig

CONF = Path(__file__).resolve().parent.parent / "conf"


def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment}, from the class's source: a comment on the field's line wins over
    the block of comment lines just above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[int, str] = {}  # 1-based line -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(tok.start[0])
    names = {f.name for f in dataclasses.fields(cls)}
    found: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        name = stripped.split(":", 1)[0].strip()
        if name not in names or name in found or not line.startswith("    ") or line.startswith("     "):
            continue
        if number in comments and number in code_lines:
            found[name] = comments[number]
            continue
        above: list[str] = []
        previous = number - 1
        while previous >= 1 and previous in comments and previous not in code_lines:
            above.insert(0, comments[previous])
            previous -= 1
        found[name] = " ".join(above)
    return found


def docstring_mention(cls: type, name: str) -> str:
    """The class docstring's sentence naming the field, when it has one."""
    doc = inspect.getdoc(cls) or ""
    if dataclasses.is_dataclass(cls) and doc.startswith(cls.__name__ + "("):
        return ""  # the signature dataclasses writes when a class has no docstring
    for sentence in " ".join(doc.split()).split(". "):
        if name in sentence:
            return sentence.rstrip(".") + "."
    return ""


def default_group_files() -> list[tuple[str, Path]]:
    """(key prefix, YAML file) of every group option conf/config.yaml starts from, and the root."""
    root = yaml.safe_load((CONF / "config.yaml").read_text())
    files = []
    for entry in root.get("defaults", []):
        if not isinstance(entry, dict):
            continue
        ((group, option),) = entry.items()
        path = CONF / str(group) / f"{option}.yaml"
        if not str(group).startswith(("override", "optional")) and option is not None and path.exists():
            files.append((f"{group}.", path))
    files.append(("", CONF / "config.yaml"))
    return files


def launch_defaults() -> dict[str, object]:
    """Dotted key -> value as conf/ sets it for `odmoe-launch` (conf/config.yaml's default options)."""
    values: dict[str, object] = {}

    def flatten(prefix: str, node: object) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                flatten(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            values[prefix] = node

    for prefix, path in default_group_files():
        node = yaml.safe_load(path.read_text()) or {}
        if not prefix:
            node = {k: v for k, v in node.items() if k not in ("defaults", "hydra")}
        flatten(prefix.rstrip("."), node)
    return values


KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w-]*):(?P<rest>.*)$")


def yaml_comments() -> dict[str, str]:
    """Dotted key -> the comment on its line in the default group files ("key: value  # comment")."""
    found: dict[str, str] = {}
    for prefix, path in default_group_files():
        stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
        for line in path.read_text().splitlines():
            match = KEY_LINE.match(line)
            if not match:
                continue
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            dotted = prefix + ".".join([key for _, key in stack] + [match["key"]])
            stack.append((indent, match["key"]))
            if " #" in match["rest"]:
                found[dotted] = match["rest"].split(" #", 1)[1].strip()
    return found


def type_name(annotation: object) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def default_of(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def shown(value: object) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str) and value == "":
        return '`""`'
    return f"`{value}`"


def cell(text: str) -> str:
    """Text safe in a table cell: pipes escaped, and `<i>` outside code spans shown, not taken as HTML."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def rows(
    cls: type, prefix: str, launch: dict[str, object], yaml_notes: dict[str, str]
) -> tuple[list[str], list[tuple[str, type]]]:
    """The table rows of `cls`'s plain fields, and its nested dataclass fields to describe after."""
    comments = field_comments(cls)
    out: list[str] = []
    nested: list[tuple[str, type]] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = default_of(f)
        if dataclasses.is_dataclass(default):
            nested.append((key, type(default)))
            continue
        meaning = comments.get(f.name) or docstring_mention(cls, f.name) or yaml_notes.get(key, "")
        in_conf = launch.get(key, default)
        launch_cell = shown(in_conf) if key in launch and in_conf != default else ""
        out.append(
            f"| `{key}` | `{cell(type_name(f.type))}` | {cell(shown(default))} | {cell(launch_cell)} "
            f"| {cell(meaning)} |"
        )
    return out, nested


def table_lines(table: list[str]) -> list[str]:
    return ["| key | type | default | odmoe-launch | meaning |", "|---|---|---|---|---|", *table, ""]


def section(key: str, cls: type, launch: dict, yaml_notes: dict[str, str], out: list[str]) -> None:
    table, nested = rows(cls, f"{key}.", launch, yaml_notes)
    out.append(f"## `{key}`\n")
    doc = inspect.getdoc(cls) or ""
    if doc and not doc.startswith(cls.__name__ + "("):
        out.append(" ".join(doc.split()) + "\n")
    out.append(f"Schema: `{cls.__module__}.{cls.__qualname__}`.\n")
    if table:
        out.extend(table_lines(table))
    for child_key, child in nested:
        section(child_key, child, launch, yaml_notes, out)


INTRO = """# Configuration reference

Every key `odmoe-launch` takes (`key=value` on its command line, or
`LocalCluster(overrides=[...])`), generated when the docs are built from the schema
`odmoe.config.OdmoeConfig` (`odmoe/config.py`) by `docs/gen_config_reference.py`, so it lists
exactly what the code accepts. *default* is the schema's, the one place defaults are written (and
`LocalCluster`'s); *odmoe-launch* is what `conf/` sets instead, where it differs: `conf/config.yaml`
itself (`model.path=demo`) and the group options it starts from (`role=local`, `cluster=local`).
Other group options (`cluster=lan_example`, `preset=paper`, `ablation=caseN`,
`role=main|worker|shadow|ray`) set keys of their own; a key given on the command line wins over all
of them, and a misspelt key fails at once. The meaning is the comment beside the field in the schema's source
(else in the YAML file that sets it). Tests' and benchmarks' knobs (`fault.*`, `emulation.*`) are
not the product's: they exist with the word `lab=on` only ([below](#the-lab-overlay-labon)).
"""

LAB_INTRO = """## The lab overlay (`lab=on`)

Tests and benchmarks, not production: the word `lab=on` composes `odmoe.config.LabConfig`, the
schema above plus the two sections below (every other key and default unchanged), e.g.
`LocalCluster(overrides=["lab=on", "fault.node=worker1", "fault.iteration=6"])` or
`odmoe-launch lab=on emulation.link.latency_ms=2`. Without it a `fault.*` or `emulation.*` word is
refused, saying so. odmoe-bench's clusters are lab clusters.
"""


def page() -> str:
    launch = launch_defaults()
    yaml_notes = yaml_comments()
    out = [INTRO]
    top, nested = rows(OdmoeConfig, "", launch, yaml_notes)
    out.append("## Top level\n")
    out.extend(table_lines(top))
    for key, cls in nested:
        section(key, cls, launch, yaml_notes, out)
    out.append(LAB_INTRO)
    product = {f.name for f in dataclasses.fields(OdmoeConfig)}
    for f in dataclasses.fields(LabConfig):
        if f.name not in product:
            section(f.name, type(default_of(f)), launch, yaml_notes, out)
    return "\n".join(out) + "\n"


with mkdocs_gen_files.open("configuration.md", "w") as md:
    md.write(page())
mkdocs_gen_files.set_edit_path("configuration.md", "gen_config_reference.py")
