"""The docs stay true to the code: every field, public name, link, cited file and code block.

Reads README.md and docs/*.md as text and the code by import (no Ray started). Each test names
what is missing or wrong, so a new field or public name fails here until it is documented.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import inspect
import os
import re
import typing
from pathlib import Path

import pytest
from annotated_types import Ge, Gt

import callbacks
import ray_trainer
import ray_trainer.demo
from callbacks import ALIASES, EVENTS, CallbackManager, TrainerControl, TrainingContext
from ray_trainer import TrainingArgs, TrainingResult

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
API = ROOT / "docs" / "api.md"
HOOK_FIELDS = EVENTS | set(ALIASES)

# ---- TrainingArgs: one row per field in docs/api.md, with its default and allowed values ------


def default_text(name: str) -> str:
    """A field's default as the api.md table writes it."""
    field = TrainingArgs.model_fields[name]
    value = field.default_factory() if field.default_factory else field.default
    return f"`{value!r}`".replace("'", '"')


def literal_values(name: str) -> list[str]:
    """The values a `Literal[...]` field allows, as written in the table (else [])."""
    annotation = TrainingArgs.model_fields[name].annotation
    if typing.get_origin(annotation) is typing.Literal:
        return [f'`"{v}"`' for v in typing.get_args(annotation)]
    return []


def bound_text(name: str) -> str | None:
    """A numeric field's bound as written in the table: "> 0", "≥ 0" (None without one)."""
    for meta in TrainingArgs.model_fields[name].metadata:
        if isinstance(meta, Gt):
            return f"> {meta.gt}"
        if isinstance(meta, Ge):
            return f"≥ {meta.ge}"
    return None


def api_table_rows() -> dict[str, list[str]]:
    """`field` -> its cells, from the rows of api.md's TrainingArgs table."""
    rows = {}
    for line in API.read_text().splitlines():
        m = re.match(r"\|\s*`([\w<>]+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def test_every_training_args_field_has_a_row_with_its_default_and_allowed_values():
    rows = api_table_rows()
    problems = []
    for name in TrainingArgs.model_fields:
        if name in HOOK_FIELDS:
            continue  # one row, `on_<event>`, below
        if name not in rows:
            problems.append(f"{name}: no row `| `{name}` | default | allowed | ... |` in api.md")
            continue
        default, allowed = rows[name][0], rows[name][1]
        if default != default_text(name):
            problems.append(
                f"{name}: default written {default!r}, the model's is {default_text(name)!r}"
            )
        missing = [v for v in literal_values(name) if v not in allowed]
        if missing:
            problems.append(f"{name}: allowed values miss {missing}")
        bound = bound_text(name)
        if bound and bound not in allowed:
            problems.append(f"{name}: allowed values should say {bound!r}")
    stale = sorted(set(rows) - set(TrainingArgs.model_fields) - {"on_<event>"})
    if stale:
        problems.append(f"rows for fields TrainingArgs no longer has: {stale}")
    assert problems == [], "\n".join(problems)


def test_the_per_event_fields_row_names_every_event_and_alias():
    row = " ".join(api_table_rows().get("on_<event>", []))
    assert row, "api.md's TrainingArgs table needs its `on_<event>` row"
    missing = sorted(e for e in HOOK_FIELDS if f"`{e}`" not in row)
    assert missing == [], f"events or aliases not named in api.md's `on_<event>` row: {missing}"


# ---- Public names: each one documented somewhere -----------------------------------------


def documented_text() -> str:
    return "\n".join(p.read_text() for p in PAGES)


def public_members() -> dict[str, list[str]]:
    """Owner -> the public names a user reads or calls on it."""
    manager = [
        n
        for n, v in vars(CallbackManager).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, property))
    ]
    manager += [
        p for p in inspect.signature(CallbackManager.__init__).parameters if p not in ("self",)
    ]
    return {
        "ray_trainer": sorted(set(ray_trainer.__all__)),
        "ray_trainer.demo": sorted(set(ray_trainer.demo.__all__)),
        "callbacks": sorted(set(callbacks.__all__)),
        "TrainingResult": [f.name for f in dataclasses.fields(TrainingResult)],
        "TrainerControl": [f.name for f in dataclasses.fields(TrainerControl)],
        "TrainingContext": list(typing.get_type_hints(TrainingContext)),
        "CallbackManager": sorted(set(manager)),
    }


@pytest.mark.parametrize("owner", list(public_members()))
def test_every_public_name_is_documented(owner):
    text = documented_text()
    code = "\n".join(source for _, _, source in python_blocks())
    missing = [
        n
        for n in public_members()[owner]
        if not re.search(rf"`[^`\n]*\b{n}\b[^`\n]*`", text) and not re.search(rf"\b{n}\b", code)
    ]
    assert missing == [], f"{owner}: public names documented nowhere (README.md, docs/): {missing}"


def test_api_md_lists_every_public_name_in_its_imports():
    block = API.read_text().split("```python", 1)[1].split("```", 1)[0]
    names = set(re.findall(r"\b\w+\b", block))
    missing = sorted(set(ray_trainer.__all__) - names)
    assert missing == [], f"api.md's import list misses {missing}"


# ---- Links and cited files ---------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A cited repository file: a path or a file name ending in one of these, in backticks or not.
CITED = re.compile(
    r"(?<![\w/.<-])((?:[\w.-]+/)*[\w.-]+\.(?:py|md|yaml|toml|json)|\.ci/run)\b(?![\w/-])"
)


def repository_files() -> list[str]:
    """The repository's files, relative to its root; hidden folders but .ci (.git, .venv),
    caches and run outputs are not walked."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d
            for d in dirs
            if (d == ".ci" or not d.startswith(".")) and d not in ("__pycache__", "runs")
        ]
        out += [(Path(folder) / f).relative_to(ROOT).as_posix() for f in files]
    return out


REPO_FILES = repository_files()
# Files the docs name that a user or a run writes, not the repository's.
NOT_REPOSITORY_FILES = {
    "callbacks.py",  # a user's own module that shadows the `callbacks` package
    "CONFIG.yaml",
    "run.yaml",
    "tasks/my_task.yaml",
    "meta.json",  # the token cache's
    "ranking.json",  # the callback actor's, in the run folder
    "lease.json",  # the run folder's lease, held by the run's driver
    "run.json",  # what a run trains and its id, in the run folder
    "model_spec.json",  # which model a checkpoint holds, in the checkpoint folder
    "adapter_config.json",  # an export's (peft, transformers)
    "config.json",
    "generation_config.json",
    "trainer_state.json",
    "ray_trainer_grafana_dashboard.json",  # written into Ray's session by `grafana install`
    "ray-trainer.json",  # a user's `grafana install --output` file
}


def cited_file_exists(cited: str) -> bool:
    """A path from the repository root, or the tail of one (`_driver/launch.py`)."""
    cited = cited.removeprefix("../")
    return any(f == cited or f.endswith("/" + cited) for f in REPO_FILES)


def anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings, as GitHub makes them."""
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_and_cited_file_exists():
    problems = []
    for page in PAGES:
        text = page.read_text()
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                problems.append(f"{page.relative_to(ROOT)}: link to {target}, which does not exist")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{page.relative_to(ROOT)}: link to {target}, no such heading")
        for cited in sorted(set(CITED.findall(text)) - NOT_REPOSITORY_FILES):
            if not cited_file_exists(cited):
                problems.append(f"{page.relative_to(ROOT)}: cites {cited}, not in the repository")
    assert problems == [], "\n".join(problems)


def test_the_docs_cite_no_internal_issue_or_private_arrangement():
    # A reader has no access to the project's issue tracker or its machines' arrangements.
    internal = re.compile(r"\b[Ii]ssues? \d+|\bthe Ray lock\b|\bRAY_FACTS\b")
    found = [
        f"{page.relative_to(ROOT)}:{i}: {m.group(0)}"
        for page in PAGES
        for i, line in enumerate(page.read_text().splitlines(), 1)
        for m in internal.finditer(line)
    ]
    assert found == [], "say what it means instead:\n" + "\n".join(found)


# ---- The README is a front page ----------------------------------------------------------

README_MAX_LINES = 250


def test_the_readme_is_a_front_page_of_at_most_250_lines_linking_every_guide():
    text = (ROOT / "README.md").read_text()
    lines = len(text.splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the details into a "
        "guide in docs/ and link it"
    )
    # What a newcomer needs stays on it: the two commands, and a way to every guide.
    assert "make demo" in text and "make test" in text
    unlinked = sorted(
        p.name for p in (ROOT / "docs").glob("*.md") if f"](docs/{p.name})" not in text
    )
    assert unlinked == [], f"guides the README's table does not link: {unlinked}"


# ---- Code blocks: every ```python block compiles and uses no undefined name ---------------

# Names a block may use without defining them: what the reader supplies. Declared here, in one
# place, so that a new one is a visible choice.
PLACEHOLDERS: set[str] = set()


def python_blocks() -> list[tuple[str, int, str]]:
    """(page, first line, source) of every ```python block."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        start = None
        for i, line in enumerate(lines):
            if start is None and line.strip() == "```python":
                start = i + 1
            elif start is not None and line.strip() == "```":
                out.append(
                    (page.relative_to(ROOT).as_posix(), start + 1, "\n".join(lines[start:i]))
                )
                start = None
    return out


def undefined_names(tree: ast.AST) -> set[str]:
    """Names read but bound nowhere in the block (scopes merged: loose, but it catches a helper
    the example calls and never defines)."""
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound


@pytest.mark.parametrize("page,line,source", python_blocks(), ids=lambda v: str(v)[:40])
def test_every_python_block_compiles_with_no_undefined_name(page, line, source):
    try:
        tree = compile(source, f"{page}:{line}", "exec", ast.PyCF_ONLY_AST)
    except SyntaxError as e:
        pytest.fail(f"{page}, the block at line {line}: {e}")
    unknown = sorted(undefined_names(tree) - PLACEHOLDERS)
    assert unknown == [], (
        f"{page}, the block at line {line} uses {unknown}, defined nowhere in it: define them "
        "there (a stub with a comment), or add a true placeholder to PLACEHOLDERS"
    )
