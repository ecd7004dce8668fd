"""A checkpoint written before `ModelSpec` moved to `_model/spec.py` still tells how to build its
model: its model_spec.pkl names the module the class had then, and `load_model` reads it."""

from __future__ import annotations

import pickle

from ray_trainer._checkpoint.format import MODEL_SPEC_FILE
from ray_trainer._checkpoint.reading import LocalCheckpoint
from ray_trainer._model.spec import ModelSpec

# The module's old name, spelt in parts as reading.py does (the path rewrite leaves it alone).
OLD = ".".join(("ray_trainer", "_models")).encode()


def test_a_spec_pickled_under_the_old_module_name_loads(tmp_path):
    spec = ModelSpec(model="tiny-lm", demo={"n_layer": 1}, max_length=64)
    # Protocol 2 names a class as text ("c<module>\n<name>\n"), so the module can be swapped.
    data = pickle.dumps(spec, protocol=2)
    assert b"ray_trainer._model.spec\nModelSpec" in data
    (tmp_path / MODEL_SPEC_FILE).write_bytes(data.replace(b"ray_trainer._model.spec", OLD))
    with_old_name = (tmp_path / MODEL_SPEC_FILE).read_bytes()
    assert OLD + b"\nModelSpec" in with_old_name
    loaded = LocalCheckpoint(folder=str(tmp_path), name="old", state=None).model_spec()
    assert type(loaded) is ModelSpec
    assert loaded == spec
