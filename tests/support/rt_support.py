"""Small parts for integration tests: a tiny model and dataset, and recording callbacks.

Imported by the test process and, through PYTHONPATH, by Ray workers and the callback actor.
Recorders append JSON lines to a file (one per process): the test reads them after the run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from typing import Any

import torch
from torch import nn
from waiting import wait_until

from callbacks import EVENTS, TrainerCallback

ALL_EVENTS = sorted(EVENTS)


class TinyRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        pred = self.net(input_ids.float()).squeeze(-1)
        return {"loss": ((pred - labels.float()) ** 2).mean()}


class TinyDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :4].sum(-1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def tiny_data_4_steps_per_epoch() -> TinyDataset:
    """64 samples: 32 per rank of 2, 4 optimizer steps of batch 8 per epoch."""
    return TinyDataset(64)


def tiny_run(tmp_path, **overrides: Any) -> dict[str, Any]:
    """The fields of a short real run: the tiny model and data, 2 workers, storage in tmp_path."""
    fields: dict[str, Any] = dict(
        model=TinyRegressor,
        data=TinyDataset,
        batch_size=8,
        num_workers=2,
        storage_path=str(tmp_path / "storage"),
        log_every_steps=100,
    )
    fields.update(overrides)
    return fields


class _FileLog:
    """Appends one JSON line per record to `<folder>/<prefix>-<pid>.jsonl`."""

    def __init__(self, folder: str, prefix: str) -> None:
        self.folder, self.prefix = folder, prefix
        self._f = None

    def write(self, **record: Any) -> None:
        if self._f is None:
            os.makedirs(self.folder, exist_ok=True)
            path = os.path.join(self.folder, f"{self.prefix}-{os.getpid()}.jsonl")
            self._f = open(path, "a")  # noqa: SIM115  (kept open across events)
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "prefix": self.prefix, "_f": None}


def read_records(folder: str, prefix: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in sorted(os.listdir(folder)):
        if name.startswith(prefix + "-"):
            with open(os.path.join(folder, name)) as f:
                out.extend(json.loads(line) for line in f if line.strip())
    return out


def rank0_ended_step(folder: str, step: int) -> bool:
    """Whether rank 0's `AllRanksRecorder` in `folder` has recorded the end of `step` (or a later
    one). Safe to call while the run writes: a line still being written counts as not yet."""
    try:
        records = read_records(folder, "all_ranks")
    except (FileNotFoundError, ValueError):
        return False
    return any(
        r["rank"] == 0 and r["event"] == "on_step_end" and r["step"] >= step for r in records
    )


def _recorder_methods():
    def make(event: str):
        def hook(self, context, **kwargs):
            self.log.write(
                event=event,
                step=context.global_step,
                epoch=context.epoch,
                rank=context.rank,
                world_size=context.world_size,
                attempt=context.attempt,
                pid=os.getpid(),
                node=_node_id(),
                t=time.monotonic(),
                checkpoint_path=context.checkpoint_path,
                val_metrics=dict(context.val_metrics or {}),
                has_model=context.model is not None,
                micro_step=kwargs.get("micro_step"),
                loss=context.loss,
                samples_seen=context.samples_seen,
            )

        hook.__name__ = event
        return hook

    return {e: make(e) for e in ALL_EVENTS}


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None


def _init(self, folder: str, prefix: str | None = None) -> None:
    self.log = _FileLog(folder, prefix or self.runs_on)


# Classes built with type() so that TrainerCallback sees every hook at class creation.
AllRanksRecorder = type(
    "AllRanksRecorder",
    (TrainerCallback,),
    {
        "__module__": __name__,
        "__doc__": "Records every event on every rank, in the training processes.",
        "runs_on": "all_ranks",
        "__init__": _init,
        **_recorder_methods(),
    },
)
ActorRecorder = type(
    "ActorRecorder",
    (TrainerCallback,),
    {
        "__module__": __name__,
        "__doc__": "Records every event it receives, on the callback actor.",
        "runs_on": "actor",
        "__init__": _init,
        **_recorder_methods(),
    },
)


class StopAt(TrainerCallback):
    """Asks to stop during one step, from rank 0 (in the training process). The request is made
    before the step's last backward, so it rides in that step's all-reduce, which the loop reads
    one step late: it acts at the next step's boundary."""

    runs_on = "rank0"

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, context, **kwargs):
        if context.global_step + 1 == self.step:  # global_step counts the finished steps
            context.control.should_training_stop = True


class Rank1SaveAfter(TrainerCallback):
    """Asks for a checkpoint from rank 1 only, in `on_step_end` of one step: a request made after
    the step's last backward, so it rides in the next step's all-reduce and acts at the boundary
    after that one (two steps later), on every rank."""

    runs_on = "all_ranks"

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, context, **kwargs):
        if context.rank == 1 and context.global_step == self.step:
            context.control.should_save = True


class StepCounter(TrainerCallback):
    """Stateful: counts the steps it saw on this rank, and keeps a count in user_state."""

    runs_on = "all_ranks"

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, context, **kwargs):
        self.steps += 1
        context.user_state["steps"] = context.user_state.get("steps", 0) + 1

    def on_train_end(self, context, **kwargs):
        _FileLog(context.args["storage_path"], "counter").write(
            rank=context.rank,
            attempt=context.attempt,
            steps=self.steps,
            user_steps=context.user_state.get("steps"),
            global_step=context.global_step,
        )

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class KillRank1Once(TrainerCallback):
    """Kills the rank-1 worker process at one step of the first attempt (a hard crash).

    With ``in_save``, in the `on_save` of the checkpoint of `step` instead: an asynchronous save
    is published at a later boundary, once every rank has written it, so a kill at a fixed step
    could land while it is still being written (and the restart would start from the save
    before). In `on_save` the checkpoint is complete and registered: the restart resumes from it.
    """

    runs_on = "all_ranks"

    def __init__(self, step: int, in_save: bool = False) -> None:
        self.step, self.in_save = step, in_save

    def _kill(self, context) -> None:
        if context.rank == 1 and context.attempt == 0 and context.global_step == self.step:
            os._exit(1)

    def on_step_end(self, context, **kwargs):
        if not self.in_save:
            self._kill(context)

    def on_save(self, context, **kwargs):
        if self.in_save:
            self._kill(context)


class HeldActorHook(TrainerCallback):
    """Actor-side: its `on_step_end` of step 1 does not return until rank 0 has ended step
    `until_step` (read from the run's `AllRanksRecorder` in `folder`), or `wait_s` passed
    (below the hook timeout); it records which in `folder` (prefix "held"). A loop that waited
    for the actor's callbacks could never take those steps while this hook is held."""

    def __init__(self, folder: str, until_step: int, wait_s: float = 45.0) -> None:
        self.folder, self.until_step, self.wait_s = folder, until_step, wait_s

    def on_step_end(self, context, **kwargs):
        if context.global_step != 1:
            return
        reached = functools.partial(rank0_ended_step, self.folder, self.until_step)
        with contextlib.suppress(AssertionError):  # the test judges what is recorded
            wait_until(reached, self.wait_s, f"rank 0 to end step {self.until_step}")
        _FileLog(self.folder, "held").write(step=1, training_went_on=reached())


class RaisingActorCallback(TrainerCallback):
    """Actor-side: raises on every event it subscribes to."""

    def on_step_end(self, context, **kwargs):
        raise RuntimeError(f"boom at {context.global_step}")

    def on_save(self, context, **kwargs):
        raise RuntimeError("boom on save")


class ActorStopAt(TrainerCallback):
    """Actor-side: asks to stop when it sees one step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, context, **kwargs):
        if context.global_step == self.step:
            context.control.should_training_stop = True


class SlowSteps(TrainerCallback):
    """Rank 0, in the training process: makes each step take at least `seconds`."""

    runs_on = "rank0"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_begin(self, context, **kwargs):
        time.sleep(self.seconds)


class ActorSaveCounter(TrainerCallback):
    """Actor-side and stateful: counts the on_save events it handled."""

    def __init__(self) -> None:
        self.saves = 0

    def on_save(self, context, **kwargs):
        self.saves += 1

    def on_train_end(self, context, **kwargs):
        _FileLog(context.args.get("storage_path") or "/tmp", "save_counter").write(saves=self.saves)

    def state_dict(self):
        return {"saves": self.saves}

    def load_state_dict(self, state):
        self.saves = state["saves"]


def read_checkpoint_step(checkpoint_path: str, step: int) -> dict[str, Any]:
    """An evaluation task body: reads the persisted checkpoint wherever the task runs."""
    with open(os.path.join(checkpoint_path, "trainer_state.json")) as f:
        state = json.load(f)
    return {"checkpoint_step": state["global_step"], "pid": os.getpid()}


class HeldEval:
    """An evaluation task body that does not finish until rank 0 has ended `ahead` more steps
    than its checkpoint's (read from the run's `AllRanksRecorder` in `folder`), or `wait_s`
    passed; its metric `training_went_on` says which (1.0 or 0.0), beside what
    `read_checkpoint_step` reads. A loop that waited for its evaluations could never take those
    steps. A checkpoint within `ahead` steps of `max_steps` is evaluated at once."""

    def __init__(self, folder: str, max_steps: int, ahead: int = 2, wait_s: float = 120.0):
        self.folder, self.max_steps, self.ahead, self.wait_s = folder, max_steps, ahead, wait_s

    def __call__(self, checkpoint_path: str, step: int) -> dict[str, Any]:
        metrics = read_checkpoint_step(checkpoint_path, step)
        until = step + self.ahead
        if until > self.max_steps:
            return metrics
        reached = functools.partial(rank0_ended_step, self.folder, until)
        with contextlib.suppress(AssertionError):  # the test judges the metric
            wait_until(reached, self.wait_s, f"rank 0 to end step {until}")
        return {**metrics, "training_went_on": float(reached())}


def constant_score_eval(checkpoint_path: str, step: int) -> dict[str, Any]:
    """Scores every checkpoint 1.0; also says how many GPUs Ray gave the task."""
    import ray

    gpus = float(len(ray.get_gpu_ids()))
    return {"score": 1.0, "gpus": gpus, **read_checkpoint_step(checkpoint_path, step)}


class GarbageReturner(TrainerCallback):
    """Returns something that is neither None nor a TrainerControl (actor-side)."""

    def on_step_end(self, context, **kwargs):
        return 42


class Rank0GarbageReturner(TrainerCallback):
    """The same, inside the rank-0 training process."""

    runs_on = "rank0"

    def on_log(self, context, **kwargs):
        return "yes"


def raising_eval(checkpoint_path: str, step: int) -> dict[str, Any]:
    raise ValueError(f"eval of step {step} broke")


def hanging_eval(checkpoint_path: str, step: int) -> dict[str, Any]:
    time.sleep(300)
    return {}


class CallableEval:
    """An evaluation given as a callable object (not a plain function)."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def __call__(self, checkpoint_path: str, step: int) -> dict[str, Any]:
        return {"offset_step": step + self.offset}


class HangingAsyncLogger(TrainerCallback):
    """Actor-side: an `async def on_log` that never returns (awaits an event nobody sets)."""

    async def on_log(self, context, **kwargs):
        import asyncio

        await asyncio.Event().wait()


class LockLater(TrainerCallback):
    """Stateful; its state holds a lock once training began (picklable before the run)."""

    def __init__(self) -> None:
        self.guard = None

    def on_train_begin(self, context, **kwargs):
        import threading

        self.guard = threading.Lock()

    def state_dict(self):
        return {"guard": self.guard}

    def load_state_dict(self, state):
        pass


class LockLaterRank0(LockLater):
    runs_on = "rank0"


class LockLaterActor(LockLater):
    runs_on = "actor"


def eval_local_checkpoint(checkpoint_path: str, step: int, checkpoint_uri: str | None = None):
    """An evaluation task body for remote storage: it gets a local folder; reads it, and loads
    the model from the URI as a notebook would."""
    from ray_trainer import load_model

    with open(os.path.join(checkpoint_path, "trainer_state.json")) as f:
        state = json.load(f)
    model = load_model(checkpoint_uri)
    return {
        "local_is_dir": os.path.isdir(checkpoint_path),
        "local_has_manifest": os.path.exists(os.path.join(checkpoint_path, "rank0.complete")),
        "checkpoint_step": state["global_step"],
        "uri": checkpoint_uri,
        "param_sum": float(sum(p.detach().sum() for p in model.parameters())),
    }


class StatusProbe(TrainerCallback):
    """Rank 0: at one step of one attempt, asks `ray-trainer status` for this run (as a user
    would, from another process) and keeps its JSON output in `<folder>/status-<pid>.jsonl`."""

    runs_on = "rank0"

    def __init__(self, folder: str, step: int, attempt: int = 0) -> None:
        self.log = _FileLog(folder, "status")
        self.step, self.attempt = step, attempt

    def on_step_end(self, context, **kwargs):
        if context.global_step != self.step or context.attempt != self.attempt:
            return
        import subprocess
        import sys

        import ray

        done = subprocess.run(
            [
                *(sys.executable, "-m", "ray_trainer.cli", "status", context.run_name),
                *("--json", "--address", ray.get_runtime_context().gcs_address),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.log.write(returncode=done.returncode, stdout=done.stdout, stderr=done.stderr[-2000:])


class ShardProbe(TrainerCallback):
    """Every rank, at the start: how many parameters this rank holds, of how many."""

    runs_on = "all_ranks"

    def __init__(self, folder: str) -> None:
        self.log = _FileLog(folder, "shards")

    def on_train_begin(self, context, **kwargs):
        params = list(context.model.parameters())
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
        self.log.write(
            rank=context.rank,
            attempt=context.attempt,
            world_size=context.world_size,
            local=local,
            total=sum(p.numel() for p in params),
        )


def eval_hf_export(checkpoint_path: str, step: int, checkpoint_uri: str | None = None):
    """An evaluation task as users write one: `from_pretrained` on `<checkpoint>/hf` (the
    code path of a process that never imports ray_trainer), compared with `load_model`."""
    import transformers

    from ray_trainer import load_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(checkpoint_path, "hf"))
    ours = load_model(checkpoint_uri).state_dict()
    theirs = hf.state_dict()
    diff = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    return {"max_abs_diff": diff, "params": sum(p.numel() for p in hf.parameters())}


class LogMetricsRecorder(TrainerCallback):
    """Actor-side: keeps every log's step, loss and batch_metrics."""

    def __init__(self, folder: str) -> None:
        self.log = _FileLog(folder, "logs")

    def on_log(self, context, **kwargs):
        self.log.write(**{**context.batch_metrics, "step": context.global_step})


class PrintOnce(TrainerCallback):
    """Rank 0, in the training process: prints one line at one step (for the console test)."""

    runs_on = "rank0"

    def __init__(self, step: int = 10) -> None:
        self.step = step

    def on_step_end(self, context, **kwargs):
        if context.global_step == self.step:
            print(f"hello from rank 0 at step {self.step}", flush=True)


class DashboardProbe(TrainerCallback):
    """Rank 0, at one step: asks the embedded Ray's dashboard (its URL in RAY_API_SERVER_ADDRESS)
    for the run's Ray Train view and its callback actor, and the node's metrics endpoint for
    the run's `ray_trainer_*` gauges; writes what it found to `path` (a JSON file)."""

    runs_on = "rank0"

    def __init__(self, path: str, step: int = 20, wait_s: float = 60.0) -> None:
        self.path, self.step, self.wait_s = path, step, wait_s

    def on_step_end(self, context, **kwargs):
        if context.global_step != self.step:
            return
        import urllib.error
        import urllib.request

        import ray
        from ray._private.authentication.http_token_authentication import (
            get_auth_headers_if_auth_enabled,
        )

        headers = get_auth_headers_if_auth_enabled({})  # the token, as the dashboard asks for

        def get(url, auth=True):
            request = urllib.request.Request(url, headers=headers if auth else {})
            try:
                with urllib.request.urlopen(request, timeout=15) as r:
                    return r.read().decode()
            except urllib.error.HTTPError as e:  # the body holds the dashboard's traceback
                return f"error: {e}: {e.read().decode(errors='replace')[-3000:]}"
            except OSError as e:
                return f"error: {e}"

        base = os.environ.get("RAY_API_SERVER_ADDRESS", "")
        node = next(n for n in ray.nodes() if n.get("Alive"))
        metrics_url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        found = {"dashboard": base, "train": "", "actors": "", "metrics": ""}

        def shows_the_run() -> bool:
            found["train"] = get(f"{base}/api/train/v2/runs/v1")
            found["actors"] = get(f"{base}/api/v0/actors?limit=1000")
            metrics = get(metrics_url, auth=False)
            found["metrics"] = "\n".join(
                line for line in metrics.splitlines() if line.startswith("ray_trainer_")
            )
            return context.run_name in found["train"] and "ray_trainer_loss{" in found["metrics"]

        # A bounded wait (gauges appear after a report); the test judges what was found.
        with contextlib.suppress(AssertionError):
            wait_until(shows_the_run, self.wait_s, "the run on the dashboard", interval=0.5)
        found["without_token"] = get(f"{base}/api/v0/actors?limit=1", auth=False)
        with open(self.path, "w") as f:
            json.dump(found, f)


class HoldWhileSmall(TrainerCallback):
    """Rank 0, in the training process: from step `at` on, while the worker group is smaller
    than `size`, hold each step (up to `timeout_s` in all), so that an elastic run cannot end
    before Ray Train has grown its group back (the growth restarts the group and ends the hold).
    """

    runs_on = "rank0"

    def __init__(self, at: int, size: int, timeout_s: float = 120.0) -> None:
        self.at, self.size, self.timeout_s = at, size, timeout_s

    def on_step_end(self, context, **kwargs):
        if context.global_step < self.at or context.world_size >= self.size:
            return
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.1)  # the group is restarted from outside while this step is held


def start_autoscaling_coordinator(tick_s: float) -> None:
    """Create Ray's autoscaling coordinator on the cluster this process joined, before any run
    does, refreshing its view of the nodes every `tick_s` instead of every 20 s.

    It is the actor Ray Train's elastic scaling (and the evaluations' reservation) asks how many
    workers fit: the same class, under the same name, namespace and options as Ray Train's own
    `get_or_create_autoscaling_coordinator`, which then finds this one. Only its period differs:
    at 20 s a run sees a lost node, or a node's return, up to 20 s late. A no-op where one is
    already up (`get_if_exists`)."""
    import ray
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as dac
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    fast = type("AutoscalingCoordinator", (dac._AutoscalingCoordinatorActor,),
                {"TICK_INTERVAL_S": tick_s})  # fmt: skip
    actor = (
        ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(fast)
        .options(
            name="AutoscalingCoordinator",
            namespace="AutoscalingCoordinator",
            get_if_exists=True,
            lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False
            ),
        )
        .remote()
    )
    ray.get(actor.get_reserved_resources.remote("ray-trainer-tests"), timeout=60)
