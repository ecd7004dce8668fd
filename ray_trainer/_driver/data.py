"""Driver: a run's data, checked before Ray starts and encoded once, in parallel, before training.

Runs in the driver. :func:`plan_data` (before ``ray.init``) resolves ``data`` and ``val_data``,
detects their format, loads the tokenizer (a chat format needs a chat template: refused here
without one), and computes the fingerprint of what the workers will train on: the records
(files' names, sizes and mtimes, a dataset's fingerprint, a Ray Dataset's plan), the tokenizer,
the template and the encoding settings (the objective and the pairs' format too, for an
objective whose description says so; the record formats each objective trains on are in its
description, ``ray_trainer._objectives``). When the token cache of that fingerprint is complete
on storage, nothing is read again; otherwise every record is checked (file and line of the first
bad one). :func:`prepare_data` (after ``ray.init``, before any worker starts) encodes what is
missing and completes the cache. Torch ``Dataset`` objects and callables pass through untouched.

Each kind of source is a plug (a `SourceKind`, registered in `SOURCE_KINDS`) that says how it
is resolved, checked and encoded; `plan_data` and `prepare_data` ask the plug, never which kind
it is. `Files` (files, globs, folders, buckets, an in-memory ``datasets.Dataset``) checks every
record here before Ray starts and encodes with one preparation task per piece, wherever the
cluster has a free CPU (below); ``RayDatasets`` (``ray_dataset.py``) has Ray Data read, check
and encode a ``ray.data.Dataset`` in one ``map_batches`` pass.

Where a file piece's records come from (`ships_content`): a real cluster shares no disk, so a local
file may exist on the driver's machine only, and the driver's node may offer no CPU (a head
node with ``CPU: 0``, where a submitted job's driver runs). The driver reads each piece of a
local file itself (it takes no CPU: it is the driver process, which has already read every
record to check it) and sends the piece's content through Ray's object store to a task that
runs on any node with a free CPU. Pinning the tasks to the driver's node instead would fail
where that node has no CPU, or, with ``num_cpus=0``, put the whole tokenization on a head meant
to train nothing. At most `pieces_in_flight` pieces (of at most 32 MiB each) are in the object
store at once, each freed when its task is done: a file larger than the driver's object store
passes through it piece by piece. A bucket's files are read by each task from the bucket, and an
in-memory ``datasets.Dataset`` goes into the object store once, whole. So the driver's memory does
not grow with a file's size: detection reads a prefix, the scan streams the file, and the driver
holds one piece at a time while it ships them; what it keeps is per sample (two int32 numbers,
its length and its scored positions, for the cache's ``lengths.npy`` and ``targets.npy``) and
per piece (its bounds).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from ray_trainer._config.args import TrainingArgs
from ray_trainer._data.cache import PieceResult, cache_location, read_meta, write_meta
from ray_trainer._data.chat import ChatTemplateError, RecordError
from ray_trainer._data.preference import PairEncoder, pair_format
from ray_trainer._data.prepare import EncodeSettings, encode_piece
from ray_trainer._data.prompts import PromptEncoder
from ray_trainer._data.records import scan
from ray_trainer._data.sources import DataFileError, Source, piece_content, resolve
from ray_trainer._driver.ray_dataset import RayDatasets
from ray_trainer._errors import TrainingArgsError
from ray_trainer._model.spec import ModelSpec
from ray_trainer._objectives import names, objective_of
from ray_trainer._storage import Location, locate

logger = logging.getLogger("ray_trainer")
_CHAT_FORMATS = ("messages", "conversational")
#: The preference formats whose pairs are conversations (rendered with the chat template).
_CHAT_PAIRS = ("conversational", "implicit_prompt")
#: At most this many pieces of a local file are in the object store at once (each at most
#: `PIECE_BYTES`, 32 MiB, or `PIECE_RECORDS` rows): what the driver's node holds of the file.
MAX_SHIPPED_PIECES = 16


class SourceKind(Protocol):
    """One kind of data source: how the driver resolves it, checks its records and builds its
    token cache (a plug: registered in `SOURCE_KINDS`, asked by `plan_data` and `prepare_data`,
    which never ask which kind it is)."""

    def takes(self, value: Any) -> bool:
        """Whether `value` (a ``data`` or ``val_data``) is a source of this kind."""

    def resolve(self, value: Any, field: str, text_field: str) -> Source | None:
        """The source (its format, columns, first record, fingerprint), before Ray starts where
        it can; None for what ray-trainer does not encode (a torch Dataset, a callable)."""

    def check(self, source: Source, args: TrainingArgs) -> None:
        """Check every record before its cache is built (files: before Ray starts)."""

    def prompts(self, source: Source, encoder: PromptEncoder, args: TrainingArgs) -> list[Any]:
        """Prompt-only records (GRPO), every one checked and tokenized, in order."""

    def build(
        self, source: Source, settings: EncodeSettings, cache: Location, args: TrainingArgs
    ) -> list[PieceResult]:
        """Encode every record into the cache folder `cache` (Ray is up, no worker yet);
        returns each piece's result, ``index`` its place."""


@dataclass
class DataPlan:
    """One source's way to the workers: its token cache, and whether it must be built."""

    source: Source
    settings: EncodeSettings
    fingerprint: str
    cache: Location  # the cache folder on the run's storage
    meta: dict[str, Any] | None  # the complete cache's meta (a hit), else None
    kind: SourceKind
    # Prompt-only records (GRPO): every prompt encoded here, in the data's order (they reach
    # the workers through Ray's object store, not a token cache: the rollout engines sample
    # their completions); None for the other formats.
    prompts: list[Any] | None = None

    @property
    def samples(self) -> int | None:
        """Samples the workers will train on (known once the cache is complete)."""
        if self.prompts is not None:
            return len(self.prompts)
        return None if self.meta is None else int(self.meta["samples"])


def plan_data(args: TrainingArgs) -> dict[str, DataPlan]:
    """The plans of ``data`` and ``val_data`` (those ray-trainer encodes), checked; no Ray (a
    ``ray.data.Dataset`` exists only where Ray is up: Ray Data reads its first record)."""
    plans: dict[str, DataPlan] = {}
    tokenizer = template = None
    for field in ("data", "val_data"):
        value = getattr(args, field)
        kind = kind_of(value)
        source = kind.resolve(value, field, args.text_field)
        check_objective(field, value, source, args)
        if source is None:
            continue
        if tokenizer is None:
            tokenizer = ModelSpec.of(args).data_tokenizer()
        pairs = _first_pair_format(source)  # None for other sources (and a bad first pair)
        chat = source.fmt in _CHAT_FORMATS or pairs in _CHAT_PAIRS
        if chat or args.chat_template is not None:
            template = template or _chat_template(tokenizer, args)
        if source.fmt == "preference":
            _check_pair_encoder(field, tokenizer, template if chat else None, args)
        settings = EncodeSettings(
            model_spec=ModelSpec.of(args),
            chat_template=template if chat else None,
            train_on=args.train_on,
            max_length=args.max_length,
            text_field=args.text_field,
            objective=args.objective,
            pair_format=pairs,
        )
        fp = fingerprint(source, settings, tokenizer)
        location = cache_location(locate(args.storage_path, args.storage_filesystem), fp)
        if source.fmt == "prompts":
            prompts = _plan_prompts(field, source, kind, tokenizer, args)
            plans[field] = DataPlan(source, settings, fp, location, None, kind, prompts)
            continue
        # A source whose fingerprint does not cover its content is encoded at every start.
        meta = read_meta(location) if source.stable else None
        if meta is None:
            kind.check(source, args)  # every record (files: before Ray starts)
        plans[field] = DataPlan(source, settings, fp, location, meta, kind)
    return plans


def kind_of(value: Any) -> SourceKind:
    """The kind of source `value` is: the first of `SOURCE_KINDS` that takes it."""
    return next(kind for kind in SOURCE_KINDS if kind.takes(value))


def _plan_prompts(
    field: str, source: Source, kind: SourceKind, tokenizer: Any, args: TrainingArgs
) -> list[Any]:
    """Every prompt record checked and tokenized (room left for the completion within
    ``max_length``), and the reward functions checked against the data's columns."""
    from ray_trainer._agents.tools import agent_prompts
    from ray_trainer._objectives.grpo import config_of
    from ray_trainer._rollout.rewards import resolve_reward_fns

    agent = agent_prompts(args, tokenizer)  # multi-turn: the tools' schemas, the template checked
    try:
        encoder = PromptEncoder(
            tokenizer, max_length=args.max_length, chat_template=args.chat_template,
            max_completion_length=config_of(args).max_completion_length, **agent,
        )  # fmt: skip
    except (ChatTemplateError, ValueError) as e:
        raise TrainingArgsError(f"{field}: {e}") from None
    encoded = kind.prompts(source, encoder, args)
    columns = sorted({k for p in encoded for k in p.columns})
    resolve_reward_fns(args.reward_fns, columns=columns)
    return encoded


def check_objective(field: str, value: Any, source: Source | None, args: TrainingArgs) -> None:
    """Refuse, before Ray starts, data the objective does not train on (its description's
    ``data_formats``): DPO reads preference pairs (from files or a ``datasets.Dataset``) for
    ``data`` and ``val_data`` alike, and SFT refuses them (its loss has no meaning on a pair)."""
    objective = objective_of(args.objective)
    example = f", e.g. {objective.data_example}" if objective.data_example else ""
    if source is None:
        if value is not None and not objective.takes_datasets:
            raise TrainingArgsError(
                f"{field}: objective={objective.name!r} reads {objective.data_noun} from files, "
                f"a datasets.Dataset or a ray.data.Dataset, got a {type(value).__name__}; write "
                f"them to a JSONL or Parquet file{example}, and pass its path"
            )
        return
    if objective.takes(source.fmt):
        return
    held = {
        "messages": "'messages' records",
        "conversational": "prompt/completion records (lists of messages)",
        "prompt_completion": "prompt/completion records",
        "text": f"{args.text_field!r} text records",
        "preference": "preference pairs (chosen/rejected)",
        "prompts": "prompt-only records (no completion)",
    }.get(source.fmt, f"{source.fmt!r} records")
    owners = [o.name for o in map(objective_of, names()) if o.takes(source.fmt)]
    fix = f"set objective={owners[0]!r} to train on them, or " if owners else ""
    raise TrainingArgsError(
        f"{field}: {source.name} holds {held}; objective={objective.name!r} trains on "
        f"{objective.data_noun}{example}; {fix}point {field} at such records"
    )


def _first_pair_format(source: Source) -> str | None:
    """A preference source's pair format, told from its first record (what decides whether its
    pairs need the chat template); `scan` checks that every record shares it."""
    if source.fmt != "preference":
        return None
    try:
        return pair_format(source.first)
    except RecordError:
        return None  # `scan` names it, with the others


def _check_pair_encoder(
    field: str, tokenizer: Any, template: str | None, args: TrainingArgs
) -> None:
    """Refuse here what would fail every preparation task: a tokenizer pairs cannot use."""
    try:
        PairEncoder(tokenizer, chat_template=template, max_length=args.max_length)
    except ChatTemplateError as e:
        raise TrainingArgsError(f"{field}: {e}") from None
    except ValueError:
        raise TrainingArgsError(
            f"max_length={args.max_length} with objective='dpo': a pair needs at least a prompt "
            "token and an answer token; raise max_length"
        ) from None


def _chat_template(tokenizer: Any, args: TrainingArgs) -> str:
    """The chat template's text (``chat_template``, or the tokenizer's own), checked: it
    renders a plain conversation's contents in order."""
    from ray_trainer._data.chat import ChatTemplateError
    from ray_trainer._data.encode import Encoder

    encoder = Encoder(
        tokenizer, chat_template=args.chat_template, train_on=args.train_on,
        max_length=args.max_length, text_field=args.text_field,
    )  # fmt: skip
    try:
        encoder.check_template()
    except ChatTemplateError as e:
        raise TrainingArgsError(f"data: {e}") from None
    return encoder.chat_template


def fingerprint(source: Source, settings: EncodeSettings, tokenizer: Any) -> str:
    """What decides a source's samples, in 20 hex digits (the cache folder's name)."""
    body = {
        "records": source.fingerprint,
        "format": source.fmt,
        "tokenizer": tokenizer_identity(tokenizer),
        "template": settings.chat_template,
        "train_on": settings.train_on if source.fmt in _CHAT_FORMATS else None,
        "max_length": settings.max_length,
        "text_field": settings.text_field,
    }
    if objective_of(settings.objective).names_cache:  # SFT's caches keep the names they had
        body.update(objective=settings.objective, pair_format=settings.pair_format)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:20]


def tokenizer_identity(tokenizer: Any) -> str:
    """A digest of everything about a tokenizer that changes its ids: the fast tokenizer's
    whole serialisation (vocabulary, merges, normaliser), its special tokens and options."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else type(tokenizer).__qualname__
    options = {
        "class": type(tokenizer).__qualname__,
        "special": getattr(tokenizer, "special_tokens_map", None),
        "bos": getattr(tokenizer, "add_bos_token", None),
        "eos": getattr(tokenizer, "add_eos_token", None),
        "eos_id": getattr(tokenizer, "eos_token_id", getattr(tokenizer, "eos_id", None)),
    }
    text += json.dumps(options, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def prepare_data(plans: dict[str, DataPlan], args: TrainingArgs) -> dict[str, str]:
    """Encode every source whose cache is missing, in parallel Ray tasks, and complete its
    cache; returns ``field -> cache folder`` for the workers. Ray is initialised; no worker
    exists yet. Raises `DataFileError` for a record the template cannot render (where it is)
    and when no record keeps a token to learn from."""
    plans = {f: p for f, p in plans.items() if p.prompts is None}  # prompts: no cache
    for field, plan in plans.items():
        if plan.meta is None:
            plan.meta = _build(plan, args)
        _report_dropped(field, plan.meta, args)
    return {field: plan.cache.name for field, plan in plans.items()}


def _build(plan: DataPlan, args: TrainingArgs) -> dict[str, Any]:
    started = time.perf_counter()
    results = plan.kind.build(plan.source, plan.settings, plan.cache, args)
    return finish_cache(plan, args, results, time.perf_counter() - started)


class Files:
    """The source kind of files, globs, folders and buckets (and of an in-memory
    ``datasets.Dataset``, cut into pieces of its table): resolved and checked in the driver
    before Ray starts, encoded by one Ray task per piece (see the module's docstring). It takes
    any value: the last of `SOURCE_KINDS`."""

    def takes(self, value: Any) -> bool:
        return True

    def resolve(self, value: Any, field: str, text_field: str) -> Source | None:
        return resolve(value, field, text_field)

    def check(self, source: Source, args: TrainingArgs) -> None:
        scan(source, args.text_field, args.train_on)

    def prompts(self, source: Source, encoder: PromptEncoder, args: TrainingArgs) -> list[Any]:
        encoded: list[Any] = []
        scan(source, args.text_field, args.train_on, prompt_encoder=encoder, encoded=encoded)
        return encoded

    def build(
        self, source: Source, settings: EncodeSettings, cache: Location, args: TrainingArgs
    ) -> list[PieceResult]:
        return _encode_in_tasks(source, settings, cache, args)


#: The kinds of source `data` and `val_data` may be, asked in order (the files' last).
SOURCE_KINDS: tuple[SourceKind, ...] = (RayDatasets(), Files())


def _encode_in_tasks(
    source: Source, settings: EncodeSettings, cache_location: Location, args: TrainingArgs
) -> list[PieceResult]:
    """One Ray task per piece of `source` (at most `pieces_in_flight` at once), each writing
    its piece of the cache; their results, as they come."""
    import ray

    ship = ships_content(source)
    # One CPU per task, on whichever node has one: never pinned to the driver's node.
    task = ray.remote(_encode_task).options(num_cpus=1, max_retries=1)
    # What every task needs of the source, put once: not its pieces (one task, one piece; a
    # 10 GiB file has thousands of them) nor its table (an ObjectRef of its own).
    bare = ray.put(Source(**{**source.__dict__, "table": None, "pieces": []}))
    table_ref = ray.put(source.table) if source.table is not None else None
    limit = pieces_in_flight(ship, ray.cluster_resources().get("CPU", 0), len(source.pieces))
    fs, cache = args.storage_filesystem, cache_location.name
    todo = iter(enumerate(source.pieces))
    running: set[Any] = set()
    results: list[PieceResult] = []
    while True:
        for i, piece in itertools.islice(todo, limit - len(running)):
            content = piece_content(piece) if ship else None  # read here, on the driver
            running.add(task.remote(bare, i, piece, settings, cache, fs, table_ref, content))
        if not running:
            break
        done, _ = ray.wait(list(running), num_returns=1)
        for ref in done:
            running.discard(ref)  # its content leaves the object store with the task
            try:
                results.append(ray.get(ref))
            except Exception as e:  # the task's DataFileError, wrapped by Ray
                for other in running:
                    ray.cancel(other, force=True)
                cause = getattr(e, "cause", None)
                if isinstance(cause, DataFileError):
                    raise DataFileError(str(cause)) from None
                raise
    return results


def ships_content(source: Source) -> bool:
    """Whether the driver reads `source`'s pieces and sends their content to the preparation
    tasks: yes for local files (a path on the driver's machine, which no other node need see);
    no for a bucket's files, which each task reads from the bucket, and for an in-memory
    dataset, which goes into the object store once, whole."""
    return bool(source.files) and _local_files(source)


def pieces_in_flight(ship: bool, cluster_cpus: float, pieces: int) -> int:
    """How many preparation tasks of a source are submitted at once. Shipped content waits in
    the driver's object store until its task runs: one piece per CPU of the cluster, at least 2
    and at most `MAX_SHIPPED_PIECES`. Tasks that read their piece themselves: all at once."""
    if not ship:
        return max(1, pieces)
    return int(min(MAX_SHIPPED_PIECES, max(2, cluster_cpus)))


def finish_cache(
    plan: DataPlan, args: TrainingArgs, results: list[PieceResult], wall_s: float
) -> dict[str, Any]:
    """Complete a source's cache from its pieces' results (its meta last); returns the meta."""
    source = plan.source
    meta = {
        "fingerprint": plan.fingerprint,
        "source": source.name,
        "format": source.fmt,
        "records": sum(r.records for r in results),
        "truncated": sum(r.truncated for r in results),
        "dropped": sum(r.dropped for r in results),
        "dropped_where": [w for r in results for w in r.dropped_where][:5],
        "tokens": int(sum(int(r.lengths.sum()) for r in results)),
        "cpu_s": round(sum(r.cpu_s for r in results), 3),
        "wall_s": round(wall_s, 3),
    }
    if source.fmt == "preference":  # each kept pair: samples 2i (chosen) and 2i + 1 (rejected)
        meta["pairs"] = sum(len(r.lengths) for r in results) // 2
        meta["pair_format"] = plan.settings.pair_format
    write_meta(plan.cache, meta, results)
    return read_meta(plan.cache) or meta


def _encode_task(source: Source, index: int, piece: Any, settings: Any, cache: str, fs: Any,
                 table: Any, content: Any) -> PieceResult:  # fmt: skip
    """The body of a preparation task (on any node): one piece into the cache, from the
    source's table, the piece's content as the driver read it, or the piece's file."""
    if table is not None:
        source.table = table
    return encode_piece(source, index, piece, settings, cache, fs, content)


def _local_files(source: Source) -> bool:
    return any("://" not in f.name for f in source.files)


def _report_dropped(field: str, meta: dict[str, Any], args: TrainingArgs) -> None:
    dropped, where = int(meta.get("dropped", 0)), meta.get("dropped_where", [])
    if not dropped:
        return
    shown = ", ".join(where) + (", ..." if dropped > len(where) else "")
    if meta.get("format") == "preference":
        if int(meta["samples"]) == 0:
            raise DataFileError(
                f"{field}: none of the {meta['records']} pair(s) of {meta['source']} fits: each "
                f"has a prompt that alone fills max_length={args.max_length} (e.g. {shown}); "
                "raise max_length"
            )
        logger.warning(
            "%s: %d of %d pair(s) have a prompt that alone fills max_length=%d; they are left "
            "out (%s); raise max_length to keep them",
            field, dropped, meta["records"], args.max_length, shown,
        )  # fmt: skip
        return
    what = "an assistant token" if meta.get("format") in _CHAT_FORMATS else "a token to learn from"
    if int(meta["samples"]) == 0:
        raise DataFileError(
            f"{field}: none of the {meta['records']} record(s) of {meta['source']} keeps {what} "
            f"within max_length={args.max_length} (e.g. {shown}); raise max_length, or check "
            "train_on and the data"
        )
    logger.warning(
        "%s: %d of %d record(s) keep no %s within max_length=%d and are left out (%s); raise "
        "max_length to keep them",
        field, dropped, meta["records"], what.split(" ", 1)[1], args.max_length, shown,
    )  # fmt: skip
