"""Runs on the callback actor (by default): the ready-made callbacks, one module each.

Users import them from ``callbacks`` (``from callbacks import EarlyStopping``); a module here is
named after what it holds: ``early_stopping``, ``divergence``, ``eval_on_save``, ``lm_eval``,
``generation`` (a package: ``GenerationEval`` in ``generation.eval``, with ``prompts``,
``samples``, ``process`` and ``child/``, the generating program it runs in the eval task or as a
subprocess),
``progress``, ``jsonl``, ``tensorboard``, ``ray_metrics``, ``mlflow``, ``wandb``. Beneath them:
``run_files`` (the base of the file loggers), ``tracker`` (the base of the experiment-tracker
loggers) and ``common`` (helpers). They stand on the callback core (``callbacks._callback``,
``callbacks._events``) and never import ``callbacks`` itself; Ray, torch and the trackers are
imported inside the hooks that need them, so importing this package stays light.
"""
