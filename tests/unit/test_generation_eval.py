"""GenerationEval: prompts read and checked at construction, the model an export resolves to,
scoring, the samples file, and generation for real on a tiny saved chat model: in this process
(the child's Session), in a subprocess of an interpreter (python=), on a LoRA adapter, and the
child's refusals (rows too long, no vLLM) and a subprocess that hangs or dies."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import stat
import subprocess
import sys

import pytest
from waiting import wait_until

from callbacks import GenerationEval
from callbacks.builtin.generation.eval import ChildDied, normalize, samples_of

CHAT = [{"role": "user", "content": "what does the cat do ?"}]
#: A model position limit small enough to refuse a long request.
MAX_POSITIONS = 96


# ---- construction ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"prompts": []}, "no prompts"),
        ({"prompts": ["a", {"text": "b"}]}, r"prompts\[1\] has neither a 'prompt'.*'messages'"),
        ({"prompts": ["a", "b"], "references": ["x"]}, r"one reference per prompt \(2\), got 1"),
        ({"prompts": ["a"], "references": ["x"], "metrics": ["bleu"]}, r"unknown metric.*bleu"),
        ({"prompts": ["a"], "score": "exact"}, "score must be a function"),
        ({"prompts": ["a", {"prompt": "b", "reference": "y"}], "metrics": ["contains"]},
         r"rows \[0\] have none"),
        ({"prompts": ["a"], "backend": "tgi"}, "backend must be one of"),
        ({"prompts": ["a"], "engine": {"dtyp": "float32"}}, r"unknown engine option.*dtyp"),
        ({"prompts": [[{"role": "user"}]]}, r"prompts\[0\]: messages must be"),
        ({"prompts": ["a"], "name": "a/b"}, "name must be a plain word"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_at_construction_naming_the_row_and_the_fix(kwargs, match):
    prompts = kwargs.pop("prompts")
    with pytest.raises((ValueError, TypeError), match=match):
        GenerationEval(prompts, **kwargs)


ROWS = [
    {"prompt": "2 + 2 =", "reference": "4"},
    {"messages": [*CHAT, {"role": "assistant", "content": "it sits"}]},
    {"prompt": CHAT, "reference": ["sits", "sleeps"]},
]
EXPECTED = [
    {"row": 0, "prompt": "2 + 2 =", "messages": None, "reference": "4"},
    {"row": 1, "prompt": None, "messages": CHAT, "reference": "it sits"},  # the last answer
    {"row": 2, "prompt": None, "messages": CHAT, "reference": ["sits", "sleeps"]},
]


COLUMNS = ["prompt", "messages", "reference"]


def _read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _write(path, rows):
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        cells = [
            {k: json.dumps(r[k]) if k == "messages" and k in r else r.get(k) for k in COLUMNS}
            for r in rows
        ]
        pq.write_table(pa.Table.from_pylist(cells), path)
    else:
        import csv

        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, COLUMNS)
            writer.writeheader()
            for r in rows:
                writer.writerow({k: json.dumps(v) if k == "messages" else v for k, v in r.items()})
    return path


def test_prompts_from_a_list_and_from_each_file_format_are_the_same_rows(tmp_path):
    assert GenerationEval(ROWS).rows == EXPECTED
    # Parquet and CSV hold text cells: messages as a JSON list, one reference per row.
    flat = [ROWS[0], ROWS[1], {"messages": CHAT, "reference": "sits"}]
    flat_expected = [*EXPECTED[:2], {**EXPECTED[2], "reference": "sits"}]
    for suffix in (".jsonl", ".json"):
        assert GenerationEval(_write(tmp_path / f"p{suffix}", ROWS)).rows == EXPECTED, suffix
    for suffix in (".parquet", ".csv"):
        rows = GenerationEval(_write(tmp_path / f"p{suffix}", flat)).rows
        assert rows == flat_expected, suffix
    plain = GenerationEval(["hello", CHAT], references=["hi", "sits"])
    assert [r["reference"] for r in plain.rows] == ["hi", "sits"]
    assert plain.metrics == ("exact_match",)
    assert GenerationEval(["no reference"]).metrics == ()  # nothing to compare with
    again = pickle.loads(pickle.dumps(GenerationEval(_write(tmp_path / "q.jsonl", ROWS))))
    assert again.rows == EXPECTED  # the rows travel with the function, not the file


def test_a_malformed_prompts_file_is_named_with_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object"):
        GenerationEval(bad)
    with pytest.raises(ValueError, match=r"\.txt"):
        GenerationEval(tmp_path / "p.txt")
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        GenerationEval(tmp_path / "missing.jsonl")
    (tmp_path / "row.jsonl").write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(ValueError, match=r"row.jsonl, row 1 has neither.*\['question'\]"):
        GenerationEval(tmp_path / "row.jsonl")


# ---- scoring and samples, with canned answers (pure logic) ---------------------------------


class _Canned:
    """A session answering every request with `answers` (the generation itself is tested below)."""

    def __init__(self, answers, requests):
        self.answers, self.requests, self.closed = answers, requests, False

    def handle(self, request):
        self.requests.append(request)
        n = len(request["prompts"])
        return {
            "ok": True, "backend": "hf", "answers": self.answers, "prompt_tokens": [5] * n,
            "answer_tokens": [2 * (i + 1) for i in range(n)],
            "finish_reasons": ["stop"] * (n - 1) + ["length"], "fallback": None,
            "seconds": {"load": 1.5, "generate": 0.25},
        }  # fmt: skip

    def close(self):
        self.closed = True


class CannedEval(GenerationEval):
    answers: list = []
    requests: list = []
    sessions: list = []

    def _session(self, backend):
        self.sessions.append(_Canned(self.answers, self.requests))
        return self.sessions[-1]


def _checkpoint(tmp_path, name="checkpoint_00000004"):
    hf = tmp_path / name / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    return str(tmp_path / name)


def _length(prompt, answer, reference):
    return {"chars": len(answer), "has_ref": reference is not None}


def test_scores_are_normalized_averaged_and_named_with_the_prefix(tmp_path):
    ckpt = _checkpoint(tmp_path)
    fn = CannedEval(ROWS, name="qa", metrics=["exact_match", "contains"], score=_length)
    fn.answers = ["  4\n", "It   SITS", "the cat sleeps"]
    metrics = fn(ckpt, 4)
    assert metrics == {
        "qa/exact_match": pytest.approx(2 / 3),  # "4" and "it sits"; row 2 only contains one
        "qa/contains": 1.0,
        "qa/chars": pytest.approx((4 + 9 + 14) / 3),
        "qa/has_ref": 1.0,
        "qa/answer_tokens_mean": 4.0,
        "qa/length_stopped": pytest.approx(1 / 3),
        "qa/vllm": 0.0,
        "qa/engine_reused": 0.0,
        "qa/load_s": 1.5,
        "qa/generate_s": 0.25,
        "qa/samples": os.path.join(ckpt, "eval", "qa.jsonl"),
    }
    assert normalize("  Paris \n Texas ") == "paris texas"
    request = fn.requests[-1]
    assert request["prompts"] == [{"text": "2 + 2 ="}, {"messages": CHAT}, {"messages": CHAT}]
    assert request["model"] == os.path.join(ckpt, "hf") and request["adapter"] is None
    assert request["max_new_tokens"] == 128 and request["engine"]["device"] == "cpu"
    # "auto" here, without vLLM: transformers in this process.
    assert request["backend"] == ("hf" if importlib.util.find_spec("vllm") is None else "auto")
    assert fn.sessions[-1].closed


class _Dying(_Canned):
    """A kept session whose process dies at its first `deaths` requests."""

    deaths = 0

    def handle(self, request):
        if _Dying.deaths:
            _Dying.deaths -= 1
            raise ChildDied("exited with code -9")
        return super().handle(request)


class KeptEval(CannedEval):
    def _session(self, backend):
        self.sessions.append(_Dying(self.answers, self.requests))
        return self.sessions[-1]


def test_keep_engine_keeps_one_session_across_evaluations_until_close(tmp_path):
    fn = KeptEval(["a"], keep_engine=True)
    fn.answers, fn.sessions, fn.requests = ["a"], [], []
    fn(_checkpoint(tmp_path, "checkpoint_00000001"), 1)
    fn(_checkpoint(tmp_path, "checkpoint_00000002"), 2)
    assert len(fn.sessions) == 1 and not fn.sessions[0].closed  # warm between checkpoints
    assert [r["model"].split(os.sep)[-2] for r in fn.requests] == [
        "checkpoint_00000001", "checkpoint_00000002",
    ]  # fmt: skip
    travelled = pickle.loads(pickle.dumps(fn))
    assert travelled.keep_engine and travelled._warm is None  # a session never travels
    assert fn.persistent and not CannedEval(["a"]).persistent  # an evaluator actor keeps it
    fn.close()
    assert fn.sessions[0].closed and fn._warm is None
    one_off = CannedEval(["a"])
    one_off.answers, one_off.sessions = ["a"], []
    one_off(_checkpoint(tmp_path, "checkpoint_00000003"), 3)
    assert [s.closed for s in one_off.sessions] == [True]  # without keep_engine: ends each time


def test_a_kept_engine_that_dies_is_restarted_once_then_its_death_is_the_error(tmp_path):
    fn = KeptEval(["a"], keep_engine=True)
    fn.answers, fn.sessions, fn.requests = ["a"], [], []
    _Dying.deaths = 1
    assert fn(_checkpoint(tmp_path, "checkpoint_00000001"), 1)["generation/vllm"] == 0.0
    assert len(fn.sessions) == 2 and fn.sessions[0].closed and not fn.sessions[1].closed
    _Dying.deaths = 2
    with pytest.raises(RuntimeError, match="died again after its restart"):
        fn(_checkpoint(tmp_path, "checkpoint_00000005"), 5)
    assert fn._warm is None and all(s.closed for s in fn.sessions)
    _Dying.deaths = 0


def test_a_kept_session_that_fails_otherwise_is_dropped_for_a_fresh_one(tmp_path):
    fn = KeptEval(["a"], keep_engine=True)
    fn.answers, fn.sessions, fn.requests = ["a"], [], []
    ckpt = _checkpoint(tmp_path)
    fn(ckpt, 1)
    fn.sessions[0].handle = lambda request: (_ for _ in ()).throw(TimeoutError("no answer"))
    with pytest.raises(TimeoutError):
        fn(ckpt, 2)
    assert fn.sessions[0].closed and fn._warm is None
    fn(ckpt, 3)
    assert len(fn.sessions) == 2 and not fn.sessions[1].closed
    fn.close()


def test_every_row_lands_whole_in_the_checkpoints_samples_file(tmp_path):
    ckpt = _checkpoint(tmp_path)
    fn = CannedEval(ROWS, score=_length)
    fn.answers = ["4", "no", "sleeps"]
    metrics = fn(ckpt, 4)
    path = metrics["generation/samples"]
    assert samples_of(metrics) == {"generation": path}
    samples = _read_jsonl(path)
    assert [s["answer"] for s in samples] == ["4", "no", "sleeps"]
    assert samples[1]["prompt"] == CHAT and samples[1]["reference"] == "it sits"
    assert samples[0]["scores"] == {"exact_match": 1.0, "chars": 1.0, "has_ref": 1.0}
    assert samples[2]["finish_reason"] == "length" and samples[2]["step"] == 4
    assert os.listdir(os.path.dirname(path)) == ["generation.jsonl"]  # no temporary left
    fn.answers = ["5", "no", "no"]
    fn(ckpt, 4)  # evaluated again: replaced whole
    assert [s["answer"] for s in _read_jsonl(path)] == ["5", "no", "no"]


def test_a_downloaded_checkpoint_gets_its_samples_on_the_checkpoints_own_storage(tmp_path):
    own = _checkpoint(tmp_path / "bucket")
    copy = _checkpoint(tmp_path / "download")
    fn = CannedEval(["hi"], references=["hi"])
    fn.answers = ["hi"]
    metrics = fn(copy, 4, checkpoint_uri=f"file://{own}")
    assert metrics["generation/samples"] == f"file://{own}/eval/generation.jsonl"
    assert os.listdir(os.path.join(own, "eval")) == ["generation.jsonl"]
    assert not os.path.exists(os.path.join(copy, "eval"))
    assert _read_jsonl(os.path.join(own, "eval", "generation.jsonl"))[0]["answer"] == "hi"


def test_a_checkpoint_without_a_hugging_face_export_names_save_hf_format(tmp_path):
    (tmp_path / "checkpoint_00000002" / "hf").mkdir(parents=True)  # the demo's: no config.json
    fn = GenerationEval(["hi"])
    with pytest.raises(FileNotFoundError, match="save_hf_format=True"):
        fn(str(tmp_path / "checkpoint_00000002"), 2)


def test_a_score_that_returns_no_numbers_names_the_row(tmp_path):
    fn = CannedEval(["a", "b"], score=lambda p, a, r: {"ok": "yes" if a == "b" else 1})
    fn.answers = ["a", "b"]
    with pytest.raises(ValueError, match=r"'ok' for row 1 is 'yes'"):
        fn(_checkpoint(tmp_path), 1)


# ---- generating for real on a tiny chat model ----------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A checkpoint folder whose hf/ holds a tiny chat model (Qwen2 style, chatml template)."""
    from ray_trainer.demo import make_tiny_chat_model

    ckpt = tmp_path_factory.mktemp("tiny") / "checkpoint_00000004"
    make_tiny_chat_model(ckpt / "hf", max_position_embeddings=MAX_POSITIONS)
    return str(ckpt)


def _answers(ckpt):
    return [s["answer"] for s in _read_jsonl(os.path.join(ckpt, "eval", "gen.jsonl"))]


def test_in_process_and_subprocess_generation_agree_and_report_their_timing(tiny):
    prompts = [CHAT, "the cat sat on the"]
    inproc = GenerationEval(prompts, name="gen", backend="hf", max_new_tokens=8)(tiny, 4)
    here = _answers(tiny)
    sub = GenerationEval(
        prompts, name="gen", backend="hf", python=sys.executable, max_new_tokens=8, timeout_s=300
    )(tiny, 4)
    assert _answers(tiny) == here  # greedy: the same answers either way
    for metrics in (inproc, sub):
        assert metrics["gen/vllm"] == 0.0 and metrics["gen/generate_s"] > 0
        assert metrics["gen/load_s"] > 0 and 0 < metrics["gen/answer_tokens_mean"] <= 8
    samples = _read_jsonl(inproc["gen/samples"])
    assert {s["finish_reason"] for s in samples} <= {"stop", "length"}
    assert all(s["backend"] == "hf" and s["prompt_tokens"] > 0 for s in samples)


def test_too_long_rows_are_refused_by_row(tiny):
    fn = GenerationEval(["short", "word " * 80], backend="hf", max_new_tokens=40)
    with pytest.raises(ValueError, match=r"row 1: \d+ prompt tokens \+ 40 new > 96") as err:
        fn(tiny, 4)
    assert "row 0" not in str(err.value) and "max_new_tokens" in str(err.value)


def test_vllm_missing_is_a_clear_error_naming_what_to_install(tiny):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    fn = GenerationEval(["hi"], backend="vllm", timeout_s=120)
    with pytest.raises(RuntimeError, match="pip install vllm"):
        fn(tiny, 4)


def test_a_lora_adapter_is_evaluated_unmerged_on_its_base_like_the_merged_model(tmp_path, tiny):
    import peft
    import torch
    import transformers

    base = os.path.join(tiny, "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        lora = peft.get_peft_model(model, config)
    adapter_ckpt, merged_ckpt = tmp_path / "adapter", tmp_path / "merged"
    lora.save_pretrained(adapter_ckpt / "hf")
    lora.merge_and_unload().save_pretrained(merged_ckpt / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    tokenizer.save_pretrained(merged_ckpt / "hf")
    assert (
        json.loads((adapter_ckpt / "hf" / "adapter_config.json").read_text())[
            "base_model_name_or_path"
        ]
        == base
    )

    fn = GenerationEval([CHAT, "the dog ran"], name="gen", backend="hf", max_new_tokens=6)
    request = fn.request(str(adapter_ckpt))
    assert (request["model"], request["adapter"]) == (base, str(adapter_ckpt / "hf"))
    assert request["adapter_rank"] == 4
    fn(str(adapter_ckpt), 4)
    fn(str(merged_ckpt), 4)
    fn(tiny, 4)
    assert _answers(str(adapter_ckpt)) == _answers(str(merged_ckpt))
    assert _answers(str(adapter_ckpt)) != _answers(tiny)  # the adapter was applied


# ---- the subprocess: timeouts and deaths ---------------------------------------------------


def _fake_python(tmp_path, body):
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: its parent (this process) reaped it, or it is about to be.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_subprocess_past_its_timeout_is_killed_and_named(tmp_path):
    pidfile = tmp_path / "pid"
    python = _fake_python(tmp_path, f"echo $$ > {pidfile}; echo loading >&2; exec sleep 300")
    fn = GenerationEval(["hi"], python=python, timeout_s=1)
    with pytest.raises(RuntimeError, match=r"timeout_s=1 s; killed.*\n.*loading"):
        fn(_checkpoint(tmp_path), 1)
    pid = int(wait_until(lambda: pidfile.read_text().strip(), 10, "the pid file"))
    wait_until(lambda: not _alive(pid), 10, "the subprocess to be gone")


def test_a_subprocess_that_dies_reports_its_stderr(tmp_path):
    python = _fake_python(tmp_path, "echo 'ImportError: no torch here' >&2; exit 3")
    fn = GenerationEval(["hi"], python=python, timeout_s=60)
    with pytest.raises(RuntimeError, match=r"exited with code 3.*\n.*no torch here"):
        fn(_checkpoint(tmp_path), 1)


def test_when_the_evaluation_process_dies_the_child_and_its_group_go_too(tmp_path):
    """An evaluator killed outright (Ctrl-C's end, a cancelled task): the real generation
    child gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and ends its whole process group, so
    a process it started (vLLM's engine; here a sleeping stand-in) is gone as well."""
    pids = tmp_path / "pids"
    python = _fake_python(  # starts the stand-in in its group, then becomes the real child
        tmp_path, f'sleep 300 & echo $$ $! > {pids}; exec {sys.executable} "$@"'
    )
    holder = tmp_path / "holder.py"
    holder.write_text(
        "import sys, time\n"
        "from callbacks.builtin.generation.process import ChildProcess\n"
        f"child = ChildProcess({python!r}, 60)\n"
        "assert child.handle({'op': 'hello'})['ok']\n"
        "print('up', flush=True)\n"
        "time.sleep(300)\n"
    )
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, str(holder)], env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "up"
        child, engine = map(int, pids.read_text().split())
        assert _alive(child) and _alive(engine)
        proc.kill()  # SIGKILL: none of the holder's own code runs
        proc.wait(10)
        wait_until(lambda: not _alive(child), 20, "the child to end with its parent")
        wait_until(lambda: not _alive(engine), 20, "the child's group to end with it")
    finally:
        proc.kill()


def test_a_child_whose_input_ends_without_exit_ends_its_group(tmp_path):
    """The parent's death closes the child's input too, and that EOF may come before the
    death's SIGTERM: without an "exit" request, the child ends its group itself."""
    from callbacks.builtin.generation.process import ChildProcess

    pids = tmp_path / "pids"
    python = _fake_python(tmp_path, f'sleep 300 & echo $$ $! > {pids}; exec {sys.executable} "$@"')
    child = ChildProcess(python, 60)
    try:
        assert child.handle({"op": "hello"})["ok"]
        _, engine = map(int, pids.read_text().split())
        assert _alive(engine)
        child.process.stdin.close()  # EOF, no "exit", the parent (this process) still alive
        child.process.wait(20)
        wait_until(lambda: not _alive(engine), 20, "the child's group to end on its input's EOF")
    finally:
        child.kill()
