"""Anywhere: watching a run from outside it: its panels, the Grafana dashboard, the plot."""
