"""Multi-turn GRPO with an environment on Ray actors, end to end (``tools``/``environment_factory``).

One run: 2 gloo workers of the real local Ray (FSDP2, LoRA, packed completions), one ``hf``
rollout engine (each sync the adapter only), the environment
``agent_model.Multiplier`` (TRL's shape: ``reset``, a typed ``multiply`` tool, ``get_reward``)
in one environment actor, a tiny ChatML model warmed up to call the tool. Its first tool call
ends the environment actor's process and its second sleeps past ``tool_timeout_s``: both are
infrastructure faults, whose episodes start again from their beginning on a fresh actor and are
never scored as they were. Once step 1's checkpoint is saved (published at a later step's
boundary: saves are asynchronous), the next tool call kills rank 1 with that step's episodes in
flight: the run resumes from its latest checkpoint and samples the lost step again. What it shows: episodes have several turns and tool calls from the
first step, their tool-result tokens take no loss (``trained_tokens`` below the completion
tokens), no turn's input came back changed (``rollout/prefix_mismatch`` 0), the faulted episodes
were started again (``episodes/restarts``), the environment's own reward is logged under its
class name, ``rollouts.jsonl`` holds whole conversations, and the ledger trained every prompt
of the run exactly once.
"""

from __future__ import annotations

import functools
import json
import os

import pytest

from callbacks import TrainerCallback

PROMPTS, PER_STEP, STEPS, GENERATIONS = 12, 4, 3, 2


class Logs(TrainerCallback):
    """Rank 0: every step's metrics."""

    runs_on = "rank0"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_log(self, context, **kwargs):
        with open(os.path.join(self.folder, "logs.jsonl"), "a") as f:
            f.write(
                json.dumps({"step": context.global_step, **(context.batch_metrics or {})}) + "\n"
            )


def answered(prompts, completions, completion_ids, answer, **kwargs):
    """1.0 where the episode's last message is the product (TRL's signature; the completions
    are the episodes' messages)."""
    return [
        1.0 if c[-1].get("content", "").strip() == a else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


@pytest.fixture(scope="module")
def run(ray_session, tmp_path_factory):
    from agent_model import ArmCrash, Multiplier, make_tool_model, product_prompts

    from ray_trainer import run_training

    root = tmp_path_factory.mktemp("agents")
    model = make_tool_model(root / "model")
    with open(root / "prompts.jsonl", "w") as f:
        for record in product_prompts(PROMPTS):
            f.write(json.dumps(record) + "\n")
    faults = root / "faults"
    faults.mkdir()
    result = run_training(
        objective="grpo", model=model, data=str(root / "prompts.jsonl"), run_name="agents",
        environment_factory=functools.partial(Multiplier, faults=str(faults)),
        reward_fns=[answered], tool_timeout_s=3.0, environment_resources={"CPU": 0.1},
        grpo={"num_generations": GENERATIONS, "max_completion_length": 100, "temperature": 0.5,
              "log_completions": True},
        rollout_backend="hf", rollout_resources={"CPU": 0.5}, reward_resources={"CPU": 0.1},
        max_length=460, num_workers=2, batch_size=2, max_steps=STEPS, learning_rate=1e-3,
        log_every_steps=1, storage_path=str(root / "storage"), dashboard=False,
        save_every_steps=1, max_failures=1, callbacks=[Logs(str(root)), ArmCrash(str(faults))],
        strategy="fsdp", packing=True, lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    )  # fmt: skip
    logs = [json.loads(line) for line in (root / "logs.jsonl").open()]
    return root, result, logs


def test_episodes_call_tools_and_their_results_take_no_loss(run):
    _, result, logs = run
    assert result.global_step == STEPS and sorted({r["step"] for r in logs}) == [1, 2, 3]
    for r in logs:
        assert r["tools/call_frequency"] > 0.5  # the warmed-up model calls its tool
        assert r["episodes/turns_mean"] > 1.0
        assert r["rollout/prefix_mismatch"] == 0.0
        completions = PER_STEP * GENERATIONS
        # Tool-result tokens are in the completions but take no loss.
        assert 0 < r["trained_tokens"] < r["completions/mean_length"] * completions
        assert "rewards/Multiplier/mean" in r and "rewards/answered/mean" in r
        assert 0.0 <= r["tools/failure_frequency"] <= 1.0 and r["env/seconds"] >= 0.0


def test_faulted_episodes_start_again_and_every_prompt_is_trained_once(run):
    from ray_trainer._objectives.grpo_ledger import audit, read_states
    from ray_trainer._storage import locate

    root, result, logs = run
    faults = sorted(os.listdir(root / "faults"))
    assert faults == ["armed", "crashed", "died", "rank1.pid", "stuck"]  # every fault happened
    assert result.attempts == 2  # the crash restarted the worker group, from step 1
    assert sum(r["episodes/restarts"] for r in logs) >= 2
    segments = read_states(locate(str(root / "storage" / "agents" / "ledger")))
    starts = sorted({(g.attempt, g.restored) for g in segments})
    assert [a for a, _ in starts] == [0, 1] and starts[1][1] >= 1  # resumed from a checkpoint
    found = audit(segments)
    assert found.problems(PROMPTS, epochs=[0]) == []
    assert sorted(found.trained.values()) == [1] * PROMPTS  # the final lineage: once each


def test_rollouts_jsonl_holds_whole_conversations(run):
    root, _, _ = run
    lines = [json.loads(x) for x in (root / "storage" / "agents" / "rollouts.jsonl").open()]
    episodes = [x for x in lines if x["turns"] > 1]
    assert episodes, "no episode with a tool call was logged"
    roles = [m["role"] for m in episodes[0]["messages"]]
    assert roles[:3] == ["assistant", "tool", "assistant"]
    assert episodes[0]["messages"][0]["tool_calls"][0]["function"]["name"] == "multiply"
    assert all("restarts" in x and "tool_calls" in x for x in lines)
