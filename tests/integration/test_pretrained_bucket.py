"""A pretrained model on a bucket (issue 21, point 1): config, tokenizer and weights read from it.

No Ray: moto's S3-compatible server on 127.0.0.1 holds a tiny GPT-2 and its tokenizer, as
``save_pretrained`` wrote them. The driver's check, the model built from the bucket, a range of
rows read in place (what each FSDP rank reads of its shard) and the tokenizer are compared with
the same model loaded from the local folder.
"""

from __future__ import annotations

import os

import pytest
import torch
from s3_server import S3Server

from ray_trainer.demo import make_tiny_causal_lm

BUCKET = "ray-trainer-models"
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    local = make_tiny_causal_lm(tmp_path_factory.mktemp("gpt2"), n_layer=2, n_embd=32)
    server = S3Server()
    server.start()
    try:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        for name in os.listdir(local):
            client.upload_file(str(local / name), BUCKET, f"models/gpt2/{name}")
        client.put_object(Bucket=BUCKET, Key="models/config-only/config.json", Body=b"{}")
        yield server, str(local)
    finally:
        server.stop()


@pytest.fixture
def s3_env(bucket, monkeypatch):
    server, local = bucket
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    return f"s3://{BUCKET}/models/gpt2", local


def test_a_model_on_a_bucket_loads_as_from_pretrained_loads_it_locally(s3_env):
    from ray_trainer._model.spec import ModelSpec, check_model_ref

    uri, local = s3_env
    check_model_ref(uri)  # the driver's check: config and safetensors are there
    spec = ModelSpec(model=uri, on_jsonl=True)
    assert spec.build_meta_model().config.n_layer == 2
    model = spec.build_model()
    expected = transformers.AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert model.lm_head.weight is model.transformer.wte.weight
    text = "the cat sat on the mat"
    tokenizer = spec.build_tokenizer()  # read from the bucket too
    assert (
        tokenizer(text)["input_ids"]
        == transformers.AutoTokenizer.from_pretrained(local)(text)["input_ids"]
    )


def test_a_range_of_rows_is_read_in_place(s3_env):
    from ray_trainer._model.pretrained import SafetensorsFiles, pretrained_folder

    uri, local = s3_env
    with (
        SafetensorsFiles(pretrained_folder(uri)) as remote,
        SafetensorsFiles(pretrained_folder(local)) as here,
    ):
        whole = here.read("transformer.wte.weight")
        assert torch.equal(remote.read("transformer.wte.weight", 5, 11), whole[5:11])
        assert remote.read("transformer.wte.weight", 3, 3).shape == (0, 32)


def test_a_bucket_folder_without_safetensors_is_refused_before_training(s3_env):
    from ray_trainer._model.spec import ModelLoadError, check_model_ref

    with pytest.raises(ModelLoadError, match=r"config-only.*no \*\.safetensors"):
        check_model_ref(f"s3://{BUCKET}/models/config-only")
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        check_model_ref(f"s3://{BUCKET}/models/missing")
