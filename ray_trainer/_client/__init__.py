"""User's terminal: the commands that work with a run from outside it, never in a run's driver.

``status``, ``control`` (save, stop) and ``submit`` (with ``runtime_env``) reach a cluster
through the dashboard's job API (``job_api``) or a Ray session; ``grafana`` installs the
dashboard on a head node and ``plot`` draws a run's panels. The driver never imports this room.
"""
