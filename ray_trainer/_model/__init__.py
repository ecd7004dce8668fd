"""Every process: a run's model, described (``spec``), its structure read, its weights loaded.

``spec.ModelSpec`` says how a run's model is built (demo, factory, Hugging Face) and builds it;
``blocks`` finds its repeated blocks, ``ties`` its tied parameters, ``compile_probe`` whether
``torch.compile`` can run here; ``pretrained/`` reads safetensors weights in place. Nothing is
imported here, so that the light parts stay light (``pretrained`` imports torch).
"""
