"""Anywhere: what watching a run draws: its panels and the Grafana dashboard (pure data).

``ray-trainer grafana install`` and ``ray-trainer plot`` use them from ``_client/``.
"""
