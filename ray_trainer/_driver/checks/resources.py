"""Driver: checks of a run against the cluster's resources, before a worker starts.

Runs in the driver, joined to the cluster (or, for the embedded local Ray, before it starts):
`check_resources` refuses workers the cluster can never place (and what the objective places
beside them: GRPO's rollout engines and reward task) and `check_evaluations` an
`EvalOnSave` whose tasks no node can run, on a cluster that cannot grow; a clear error instead
of an endless wait.
"""

from __future__ import annotations

import logging
import os

from callbacks import EvalOnSave
from ray_trainer._cluster import SKIP_RESOURCE_CHECK, can_grow, live_nodes, missing
from ray_trainer._config.args import TrainingArgs
from ray_trainer._objectives import objective_of
from ray_trainer._placement import CallbackLists

logger = logging.getLogger("ray_trainer")


class ResourceRequestError(RuntimeError):
    """The cluster can never fit the requested workers; raised instead of waiting forever."""


def per_worker(args: TrainingArgs) -> dict[str, float]:
    """The Ray resources of one training worker."""
    res = dict(args.resources_per_worker) if args.resources_per_worker else {"CPU": 1.0}
    if args.use_gpu:
        res.setdefault("GPU", 1.0)
    return res


def check_resources(args: TrainingArgs, nodes: list[dict[str, float]] | None = None) -> None:
    """Fail fast when the cluster can never place `num_workers` workers of the requested size
    (an elastic run: its `min` workers).

    ``nodes`` are the resources of each node (default: the live nodes of the Ray cluster this
    driver joined; for the embedded local Ray, `embedded_resources()` before it starts). On a
    cluster that can grow (`_cluster.can_grow`: an autoscaler, or
    ``RAY_TRAINER_SKIP_RESOURCE_CHECK=1``) a shortfall is not refused: the workers' request is
    what makes the autoscaler add nodes, bounded by ``worker_start_timeout_s``.
    """
    if os.environ.get(SKIP_RESOURCE_CHECK) == "1":  # said by the user: no need to look
        return
    joined = nodes is None
    nodes = live_nodes() if nodes is None else nodes
    need = per_worker(args)
    fits = 0
    for res in nodes:
        fits += int(min(res.get(k, 0.0) / v for k, v in need.items() if v > 0))
    if fits >= args.min_workers:
        _check_beside(args, nodes, need, joined)
        return
    if joined and can_grow():
        logger.info(
            "the cluster has room for %d of %d worker(s) now; its autoscaler is asked for the "
            "rest (bounded by worker_start_timeout_s=%gs)",
            fits, args.min_workers, args.worker_start_timeout_s,
        )  # fmt: skip
        return
    have = ", ".join(f"{k}={sum(n.get(k, 0.0) for n in nodes):g}" for k in need)
    size = f"the elastic minimum {args.min_workers}" if args.elastic else args.num_workers
    raise ResourceRequestError(
        f"num_workers={size} x resources_per_worker={need} cannot be placed: "
        f"the cluster has {have} over {len(nodes)} node(s), room for {fits} such worker(s). "
        "Lower num_workers, or resources_per_worker (e.g. {'CPU': 0.5} puts two workers on "
        "a core), set use_gpu=False, or add nodes."
    )


def _check_beside(
    args: TrainingArgs, nodes: list[dict[str, float]], need: dict[str, float], joined: bool
) -> None:
    """What the objective places besides the workers (GRPO's rollout engines and a reward
    task) must fit beside them, or a step would wait for it forever: placed greedily, the
    workers first, node by node."""
    beside = objective_of(args.objective).beside_workers(args)
    if not beside:
        return
    free = [dict(n) for n in nodes]
    left = args.min_workers
    for res in free:
        while left and all(res.get(k, 0.0) >= v for k, v in need.items()):
            for k, v in need.items():
                res[k] = res.get(k, 0.0) - v
            left -= 1
    for what, want in beside:
        home = next((r for r in free if all(r.get(k, 0.0) >= v for k, v in want.items())), None)
        if home is None:
            if joined and can_grow():
                return
            have = ", ".join(f"{k}={sum(r.get(k, 0.0) for r in free):g}" for k in want)
            raise ResourceRequestError(
                f"{what} needs {want} beside the {args.min_workers} worker(s) of "
                f"{need}, and the cluster has {have} left over {len(nodes)} node(s): the step "
                "would wait for it forever. Lower resources_per_worker (e.g. {'CPU': 0.5}), "
                "rollout_resources or reward_resources (fractions share a core or a GPU), or "
                "add nodes."
            )
        for k, v in want.items():
            home[k] = home.get(k, 0.0) - v


def check_evaluations(
    lists: CallbackLists,
    nodes: list[dict[str, float]] | None = None,
    grows: bool | None = None,
) -> None:
    """Refuse a run whose `EvalOnSave` asks for resources that no node has, on a cluster that
    cannot grow: every one of its evaluations would be recorded as "cannot be scheduled".

    ``nodes`` are the resources of each node (default: the live nodes of the cluster this
    driver joined); ``grows`` whether nodes may still come (default: `_cluster.can_grow`, an
    autoscaler or ``RAY_TRAINER_SKIP_RESOURCE_CHECK=1``). With an autoscaler, the evaluation
    tasks are submitted and wait for a node, bounded by `EvalOnSave`'s ``timeout_s``.
    """
    entries = [u[1] if isinstance(u, tuple) else u for u in lists["user"]] + lists["global"]
    evals = [cb for cb in entries if isinstance(cb, EvalOnSave)]
    for cb in evals:
        need = {"CPU": cb.num_cpus, "GPU": cb.num_gpus, **cb.resources}
        nodes = live_nodes() if nodes is None else nodes
        reason = missing(need, nodes)
        if reason is None:
            continue
        grows = can_grow() if grows is None else grows
        if grows:
            return
        extra = f", resources={cb.resources}" if cb.resources else ""
        call = f"{type(cb).__name__}(num_gpus={cb.num_gpus:g}, num_cpus={cb.num_cpus:g}{extra})"
        gpu_short = cb.num_gpus and missing({**need, "GPU": 0}, nodes) is None
        fix = (
            f"pass num_gpus=0 to evaluate on CPU ({type(cb).__name__}(eval_fn, num_gpus=0)), "
            "or add a node with a GPU"
            if gpu_short
            else "ask for what a node has (num_gpus, num_cpus, resources), or add such a node"
        )
        raise ResourceRequestError(
            f"{call} could never run its evaluations: each task {reason}, and the cluster has "
            f"no autoscaler to add one. {fix[0].upper()}{fix[1:]}. (On a cluster whose "
            "autoscaler ray-trainer does not see, set RAY_TRAINER_SKIP_RESOURCE_CHECK=1.)"
        )


def embedded_resources(count_gpus: bool) -> dict[str, float]:
    """What the embedded local Ray gets: this machine's real CPUs (as Ray counts them, cgroup
    limits included) and, when ``count_gpus``, its GPUs (counting them imports torch)."""
    try:
        from ray._private.utils import get_num_cpus

        cpus = float(get_num_cpus())
    except Exception:  # a Ray without that helper: the OS's count
        cpus = float(os.cpu_count() or 1)
    gpus = 0.0
    if count_gpus and os.environ.get("CUDA_VISIBLE_DEVICES", None) != "":
        try:
            import torch

            gpus = float(torch.cuda.device_count())
        except Exception:
            gpus = 0.0
    return {"CPU": cpus, "GPU": gpus}
