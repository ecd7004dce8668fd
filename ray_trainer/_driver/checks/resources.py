"""Driver: checks of a run against the cluster's resources, before a worker starts.

Runs in the driver, joined to the cluster (or, for the embedded local Ray, before it starts):
`check_resources` refuses workers the cluster can never place (and what the run places beside
them that a step waits for: GRPO's rollout engines and a reward task; both read from the run's
`Demand`, ``demand.py``) and `check_evaluations` an `EvalOnSave` whose tasks no node can run, on
a cluster that cannot grow; a clear error instead of an endless wait.
"""

from __future__ import annotations

import logging
import os

from ray_trainer._cluster import SKIP_RESOURCE_CHECK, can_grow, live_nodes, missing
from ray_trainer._config.args import TrainingArgs
from ray_trainer._driver.checks.demand import Demand, evaluations, run_demand
from ray_trainer._placement import CallbackLists

logger = logging.getLogger("ray_trainer")


class ResourceRequestError(RuntimeError):
    """The cluster can never fit the requested workers; raised instead of waiting forever."""


def check_resources(
    args: TrainingArgs, nodes: list[dict[str, float]] | None = None, where: str = "the cluster"
) -> None:
    """Fail fast when the cluster can never place `num_workers` workers of the requested size
    (an elastic run: its `min` workers).

    ``nodes`` are the resources of each node (default: the live nodes of the Ray cluster this
    driver joined; for the embedded local Ray, `embedded_resources()` before it starts). On a
    cluster that can grow (`_cluster.can_grow`: an autoscaler, or
    ``RAY_TRAINER_SKIP_RESOURCE_CHECK=1``) a shortfall is not refused: the workers' request is
    what makes the autoscaler add nodes, bounded by ``worker_start_timeout_s``. ``where``
    names the nodes in a refusal.
    """
    if os.environ.get(SKIP_RESOURCE_CHECK) == "1":  # said by the user: no need to look
        return
    joined = nodes is None
    nodes = live_nodes() if nodes is None else nodes
    demand = run_demand(args)
    need = demand.worker
    fits = 0
    for res in nodes:
        fits += int(min(res.get(k, 0.0) / v for k, v in need.items() if v > 0))
    if fits >= args.min_workers:
        _check_beside(args, nodes, demand, joined, where)
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
        f"{where} has {have} over {len(nodes)} node(s), room for {fits} such worker(s). "
        "Lower num_workers, or resources_per_worker (e.g. {'CPU': 0.5} puts two workers on "
        "a core), set use_gpu=False, or add nodes."
    )


def _check_beside(
    args: TrainingArgs, nodes: list[dict[str, float]], demand: Demand, joined: bool, where: str
) -> None:
    """What the run places beside the workers that a step waits for (GRPO's rollout engines
    and a reward task) must fit beside them, or a step would wait for it forever: placed
    greedily, the workers first, node by node."""
    needed = [(what, b.resources) for b in demand.beside for what in b.needed]
    if not needed:
        return
    need = demand.worker
    free = [dict(n) for n in nodes]
    left = args.min_workers
    for res in free:
        while left and all(res.get(k, 0.0) >= v for k, v in need.items()):
            for k, v in need.items():
                res[k] = res.get(k, 0.0) - v
            left -= 1
    for what, want in needed:
        home = next((r for r in free if all(r.get(k, 0.0) >= v for k, v in want.items())), None)
        if home is None:
            if joined and can_grow():
                return
            have = ", ".join(f"{k}={sum(r.get(k, 0.0) for r in free):g}" for k in want)
            raise ResourceRequestError(
                f"{what} needs {want} beside the {args.min_workers} worker(s) of "
                f"{need}, and {where} has {have} left over {len(nodes)} node(s): the step "
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
    for cb in evaluations(lists):
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
