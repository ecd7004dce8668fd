"""Generated TrainingArgs and YAML configs: accepted and valid, or one TrainingArgsError naming a
field (issue 48, part 5). Never another exception: no TypeError, KeyError, OverflowError or
pydantic error escapes the Python API or the config loader.

Hypothesis draws field values of every kind (None, booleans, huge and negative integers,
infinite and NaN floats, text, bytes, lists, mappings) for a few fields at a time, so that
some combinations are accepted. Derandomized (the same examples on every run) and bounded:
300 examples per test (together about 5 s here). The callback fields are left out: their import
strings import modules (tests/unit/test_config_files_trust.py covers them); so is `lora`.
"""

from __future__ import annotations

import math

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from callbacks import ALIASES, EVENTS  # noqa: E402
from ray_trainer import TrainingArgs, TrainingArgsError  # noqa: E402
from ray_trainer._config.args import _number_fields  # noqa: E402
from ray_trainer._config.rules import SEED_MAX  # noqa: E402

CODE_FIELDS = {"callbacks", "loss_fn", *EVENTS, *ALIASES}
# `lora` imports peft (about 20 s here, once): its fields are checked in test_lora_args.py.
FIELDS = sorted(set(TrainingArgs.model_fields) - CODE_FIELDS - {"lora"})
UNKNOWN = ["bach_size", "learning_rte", "x"]

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-2, max_value=8),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["ddp", "fsdp", "sft", "dpo", "linear", "max", "PACK", "bf16", "tiny-lm"]),
    st.binary(max_size=4),
    st.lists(st.integers(min_value=-2, max_value=6), max_size=3),
    st.dictionaries(
        st.sampled_from(["CPU", "GPU", "r", "d_model", "bogus"]),
        st.integers(min_value=-1, max_value=4) | st.floats(allow_nan=True),
        max_size=2,
    ),
)
FIELDS_AND_VALUES = st.dictionaries(st.sampled_from(FIELDS + UNKNOWN), VALUES, max_size=3)
EXAMPLES = settings(
    max_examples=300,
    deadline=None,  # the first example imports pydantic's schema; the total is what is bounded
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _check(fields: dict, build) -> None:
    try:
        args = build()
    except TrainingArgsError as e:
        message = str(e)
        assert any(name in message for name in fields), (fields, message)
        return
    _assert_valid(args)


def _assert_valid(args: TrainingArgs) -> None:
    """What was accepted holds no boolean for a number, no infinite or NaN float, a seed in
    numpy's range, and validates again as it is."""
    for name in _number_fields():
        value = getattr(args, name)
        values = value if isinstance(value, (tuple, list)) else [value]
        if isinstance(value, dict):
            values = list(value.values())
        for v in values:
            assert not isinstance(v, bool), (name, value)
            assert v is None or math.isfinite(v), (name, value)
    assert 0 <= args.seed <= SEED_MAX
    assert TrainingArgs.coerce(args) == args


@EXAMPLES
@given(FIELDS_AND_VALUES)
def test_generated_fields_are_accepted_and_valid_or_refused_naming_a_field(fields):
    _check(fields, lambda: TrainingArgs.coerce(**fields))


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    return tmp_path_factory.mktemp("generated") / "run.yaml"


@EXAMPLES
@given(fields=FIELDS_AND_VALUES)
def test_generated_yaml_configs_are_accepted_and_valid_or_refused_naming_a_field(
    config_path, fields
):
    config_path.write_text(yaml.safe_dump(fields))

    def load():
        return TrainingArgs.from_yaml(config_path)

    _check({**fields, str(config_path): None}, load)


@settings(max_examples=100, derandomize=True, database=None, deadline=None)
@given(text=st.text(max_size=40))
def test_any_text_as_a_config_is_refused_naming_the_file_or_accepted(config_path, text):
    hypothesis.assume("callbacks" not in text and "on_" not in text)  # no imports from here
    config_path.write_text(text)
    try:
        args = TrainingArgs.from_yaml(config_path)
    except TrainingArgsError as e:
        assert str(config_path) in str(e)
        return
    _assert_valid(args)
