"""User's terminal: the runtime_env that ``submit`` sends, and the size of what it uploads.

Runs in the user's terminal, before anything reaches the cluster. ``build_runtime_env`` merges
``--runtime-env FILE``, ``--pip`` and ``--env`` with the working dir; ``check_upload_size``
counts the working dir's files with the rules Ray applies when it packs it (``.gitignore`` and
``.rayignore`` in every folder, the runtime_env's ``excludes``, ``.git``), using Ray's own
gitwildmatch matcher, and refuses a package over Ray's limit naming the biggest entries.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

#: Ray's limit for one working_dir package (its gRPC message size), 512 MiB unless the
#: cluster's ``RAY_max_grpc_message_size`` says otherwise.
DEFAULT_PACKAGE_LIMIT = 512 * 1024 * 1024
ALWAYS_EXCLUDED = [".git"]


class RuntimeEnvError(ValueError):
    """The runtime_env cannot be built or the working dir cannot be uploaded."""


def load_runtime_env(path: str | None) -> dict[str, Any]:
    """``--runtime-env FILE``: a YAML or JSON mapping of a Ray runtime_env (as ``ray job
    submit --runtime-env`` reads it)."""
    if path is None:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise RuntimeEnvError(f"--runtime-env {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise RuntimeEnvError(f"--runtime-env {path}: not YAML or JSON ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RuntimeEnvError(
            f"--runtime-env {path}: expected a mapping (pip, env_vars, excludes ...), "
            f"got {type(data).__name__}"
        )
    return data


def parse_env(items: list[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` (repeatable)."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RuntimeEnvError(f"--env {item!r}: expected KEY=VALUE")
        env[key] = value
    return env


def build_runtime_env(
    base: dict[str, Any],
    working_dir: str | None,
    pip: list[str],
    env: dict[str, str],
    source: str = "--runtime-env",
) -> dict[str, Any]:
    """The job's runtime_env: ``base`` (the file), the working dir to upload (with ``.git``
    excluded), ``pip`` appended to its packages and ``env`` over its env_vars. Adds nothing
    else: the job gets no variable it did not ask for."""
    runtime_env = dict(base)
    if working_dir is not None:
        if "working_dir" in base:
            raise RuntimeEnvError(
                f"{source} sets working_dir and submit uploads --working-dir: drop it from "
                "the file, or pass --no-working-dir to use the file's"
            )
        runtime_env["working_dir"] = working_dir
        excludes = list(base.get("excludes") or [])
        runtime_env["excludes"] = [*excludes, *(x for x in ALWAYS_EXCLUDED if x not in excludes)]
    if pip:
        runtime_env["pip"] = _with_pip(base.get("pip"), pip, source)
    if env:
        runtime_env["env_vars"] = {**(base.get("env_vars") or {}), **env}
    return runtime_env


def _with_pip(current: Any, extra: list[str], source: str) -> Any:
    if current is None:
        return list(extra)
    if isinstance(current, list):
        return [*current, *extra]
    if isinstance(current, dict):
        return {**current, "packages": [*(current.get("packages") or []), *extra]}
    raise RuntimeEnvError(
        f"{source}: pip is {current!r} (a requirements file); list --pip packages in it, or "
        "write pip as a list in the file"
    )


def package_limit() -> int:
    """Ray's limit, read from the variable Ray reads (its own mixed-case name)."""
    return int(os.environ.get("RAY_max_grpc_message_size") or DEFAULT_PACKAGE_LIMIT)  # noqa: SIM112


def check_upload_size(root: str, excludes: list[str], limit: int | None = None) -> int:
    """The bytes Ray would pack from ``root``; ``RuntimeEnvError`` naming the biggest
    entries and the fixes when they reach Ray's limit. Raw sizes: an upper bound of the zip
    (checkpoints, weights and data hardly compress)."""
    limit = package_limit() if limit is None else limit
    files = dict(upload_files(Path(root), excludes))
    total = sum(files.values())
    if total < limit:
        return total
    top: Counter[str] = Counter()
    for rel, size in files.items():
        first, _, rest = rel.partition("/")
        top[f"{first}/" if rest else first] += size

    def named(sizes: Counter[str], most: int) -> str:  # the entries worth moving out
        big = [(name, n) for name, n in sizes.most_common(most) if n >= total / 100]
        return ", ".join(f"{name} {_size(n)}" for name, n in big)

    biggest, files_top = named(top, 5), named(Counter(files), 3)
    raise RuntimeEnvError(
        f"the working dir {root} holds {_size(total)} to upload ({len(files)} files, after "
        f".gitignore, .rayignore and the excludes), over Ray's {_size(limit)} limit for a "
        f"working_dir package. Biggest: {biggest}; biggest files: {files_top}. Fix: list them "
        "in .gitignore or .rayignore (or `excludes` in --runtime-env), keep data and "
        "checkpoints in a bucket (s3://...) or on shared storage, pass --working-dir with a "
        "smaller folder, or --no-working-dir when every node already has the files"
    )


def upload_files(root: Path, excludes: list[str]) -> Iterator[tuple[str, int]]:
    """(POSIX path relative to ``root``, size) of each file Ray would pack: the runtime_env's
    ``excludes`` (relative to ``root``) and each folder's ``.gitignore`` (unless
    ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1``) and ``.rayignore`` (relative to that folder)."""
    spec = _pathspec()
    use_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    names = (".gitignore", ".rayignore") if use_gitignore else (".rayignore",)
    root = root.resolve()

    def walk(folder: Path, rules: list[tuple[Path, Any]]) -> Iterator[tuple[str, int]]:
        rules = rules + [
            (folder, spec.from_lines("gitwildmatch", (folder / n).read_text().splitlines()))
            for n in names
            if (folder / n).is_file()
        ]
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                path = Path(entry.path)
                if any(s.match_file(path.relative_to(base).as_posix()) for base, s in rules):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    yield from walk(path, rules)
                elif entry.is_file():
                    yield path.relative_to(root).as_posix(), entry.stat().st_size

    yield from walk(root, [(root, spec.from_lines("gitwildmatch", excludes))])


def _pathspec() -> Any:
    """The gitwildmatch matcher Ray packs working dirs with (vendored in Ray)."""
    try:
        from ray._private.thirdparty.pathspec import PathSpec
    except ImportError:  # another Ray layout: the same library, installed on its own
        from pathspec import PathSpec
    return PathSpec


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"
