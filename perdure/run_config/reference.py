"""Every config field, documented from the dataclasses themselves (docs/configuration.md).

The docstring under each field is the one source of its documentation: this module reads
them from the source with ``ast``, so the reference page cannot drift from the code (a test
regenerates it and compares).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from typing import Any

from perdure.run_config import RunConfig


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` from the string literal that follows each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if named and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            out[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]
    return out


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        plain = dataclasses.is_dataclass(value) and not isinstance(value, type)
        return repr(dataclasses.asdict(value) if plain else value)  # type: ignore[arg-type]
    return "(required)"


def _type(f: dataclasses.Field[Any]) -> str:
    return str(f.type).replace("typing.", "")


def section_markdown(name: str, cls: type) -> list[str]:
    docs = field_docs(cls)
    lines = [f"## `[{name}]` ({cls.__name__})", "", " ".join((cls.__doc__ or "").split()), ""]
    lines += ["| key | type | default | math | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        math = "yes" if f.metadata.get("math") else ""
        text = docs.get(f.name, "").replace("|", "\\|")
        lines.append(f"| `{f.name}` | `{_type(f)}` | `{_default(f)}` | {math} | {text} |")
    return [*lines, ""]


def _section(name: str) -> type:
    return type(getattr(RunConfig(), name))


def reference_markdown() -> str:
    """The whole configuration reference page."""
    from perdure.chaos.config import FaultConfig
    from perdure.runtime.config import RegionConfig

    lines = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses by `perdure config fields` (a test keeps it in",
        "sync). A run config is one TOML file whose tables map onto these sections. Fields",
        "marked *math* enter the config hash; the others decide who computes what and",
        "cannot change a bit of the result.",
        "",
    ]
    for f in dataclasses.fields(RunConfig):
        lines += section_markdown(f.name, f.type if isinstance(f.type, type) else _section(f.name))
    lines += section_markdown("cluster.regions[]", RegionConfig)
    lines += section_markdown("chaos.faults[]", FaultConfig)
    lines += fault_kinds_markdown()
    return "\n".join(lines).rstrip() + "\n"


def fault_kinds_markdown() -> list[str]:
    """The table of fault kinds, from the fault registry (one module per kind)."""
    from perdure.chaos import faults

    lines = [
        "## Fault kinds (`chaos.faults[].kind`)",
        "",
        "One class each in `perdure/chaos/faults/`. *Posted*: put in the store for the worker,",
        "which applies it itself; *timed*: `duration_s` ends it.",
        "",
        "| kind | failure class | target | posted | timed | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for kind, f in faults.REGISTRY.items():
        posted = "yes" if f.in_process else ""
        timed = "yes" if f.timed else ""
        text = " ".join((type(f).__doc__ or "").split()).replace("|", "\\|")
        lines.append(f"| `{kind}` | {f.failure_class} | {f.target} | {posted} | {timed} | {text} |")
    return [*lines, ""]
