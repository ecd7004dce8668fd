"""Driver: the checks of a run before anything starts, in two modules.

``inputs.py`` checks what the user gave (callbacks, args, data, storage) before ``ray.init()``;
``resources.py`` checks it against the cluster's resources before a worker starts.
"""
