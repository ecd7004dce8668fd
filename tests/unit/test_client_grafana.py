"""``ray-trainer grafana install``: where Ray's Grafana provisions dashboards from, and errors
that name the folder and the fix. Ray's own provider template writes the session's files."""

from __future__ import annotations

import json
import threading

import pytest
from ray.dashboard.modules.metrics.templates import DASHBOARD_PROVISIONING_TEMPLATE

from ray_trainer import cli
from ray_trainer._client import grafana
from ray_trainer._monitoring.dashboard import DASHBOARD_UID


def ray_session(root, dashboards=None):
    """A session folder as Ray's dashboard leaves it: the dashboard provider file (Ray's own
    template) naming the dashboards folder (`dashboards`: as RAY_METRICS_GRAFANA_DASHBOARD_
    OUTPUT_DIR moves it), and Ray's dashboards in it."""
    session = root / "session_latest"
    folder = dashboards or session / "metrics" / "grafana" / "dashboards"
    folder.mkdir(parents=True)
    (folder / "default_grafana_dashboard.json").write_text("{}")
    provider = session / "metrics" / "grafana" / "provisioning" / "dashboards" / "default.yml"
    provider.parent.mkdir(parents=True)
    provider.write_text(DASHBOARD_PROVISIONING_TEMPLATE.format(dashboard_output_folder=folder))
    return session, folder


@pytest.fixture(autouse=True)
def _no_metrics_root(monkeypatch):
    monkeypatch.delenv(grafana.METRICS_ROOT_ENV, raising=False)


def test_installs_beside_rays_dashboards(tmp_path, capsys):
    session, folder = ray_session(tmp_path)
    assert cli.main(["grafana", "install", "--session-dir", str(session)]) == 0
    written = folder / grafana.DASHBOARD_FILE
    assert json.loads(written.read_text())["uid"] == DASHBOARD_UID
    assert sorted(p.name for p in folder.iterdir()) == [
        "default_grafana_dashboard.json",
        grafana.DASHBOARD_FILE,
    ]  # no temporary file left behind
    assert str(written) in capsys.readouterr().out
    assert cli.main(["grafana", "install", "--session-dir", str(session)]) == 0  # again: replaced


def test_follows_the_folder_the_heads_provider_names(tmp_path):
    # RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR set on the head moves the folder; the provider
    # file says where, whatever this shell's environment says.
    session, folder = ray_session(tmp_path, dashboards=tmp_path / "elsewhere")
    assert grafana.install(str(session)) == folder / grafana.DASHBOARD_FILE


def test_the_metrics_output_root_variable_moves_the_metrics_folder(tmp_path, monkeypatch):
    # RAY_METRICS_OUTPUT_ROOT on the head: Ray writes metrics/ there, not in the session.
    session, _ = ray_session(tmp_path)
    moved = tmp_path / "metrics-root"
    (session / "metrics").rename(moved)
    with pytest.raises(grafana.InstallError, match="no Grafana provisioning"):
        grafana.dashboards_folder(str(session))
    monkeypatch.setenv(grafana.METRICS_ROOT_ENV, str(moved))
    provider = moved / grafana.PROVIDER_FILE
    provider.write_text(
        DASHBOARD_PROVISIONING_TEMPLATE.format(dashboard_output_folder=moved / "grafana/dashboards")
    )
    assert grafana.dashboards_folder(str(session)) == moved / "grafana" / "dashboards"


def test_no_session_names_the_folder_and_the_fixes(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert cli.main(["grafana", "install", "--session-dir", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"no Ray session at {missing}" in err
    assert "ray start --head" in err and "--output FILE" in err


def test_a_session_without_the_dashboard_says_to_start_it(tmp_path):
    session = tmp_path / "session_latest"
    session.mkdir()  # ray start --head --include-dashboard=false: no metrics/grafana
    with pytest.raises(grafana.InstallError) as caught:
        grafana.install(str(session))
    message = str(caught.value)
    assert str(session / "metrics" / "grafana" / "provisioning") in message
    assert "ray[default]" in message and "--wait" in message


def test_waits_for_rays_dashboard_to_write_its_files(tmp_path):
    session = tmp_path / "session_latest"
    done = threading.Event()

    def ray_dashboard_starts():
        ray_session(tmp_path)
        done.set()

    timer = threading.Timer(0.3, ray_dashboard_starts)
    timer.start()
    try:
        with pytest.raises(grafana.InstallError):
            grafana.install(str(session), wait_s=0)  # not yet
        path = grafana.install(str(session), wait_s=30)
    finally:
        timer.cancel()
    assert done.is_set() and path.is_file()


def test_output_writes_the_json_for_ones_own_grafana(tmp_path, capsys):
    target = tmp_path / "ray-trainer.json"
    assert cli.main(["grafana", "install", "--output", str(target)]) == 0
    assert json.loads(target.read_text())["uid"] == DASHBOARD_UID
    assert "Import" in capsys.readouterr().out
    bad = tmp_path / "no-such-folder" / "x.json"
    assert cli.main(["grafana", "install", "--output", str(bad)]) == 2
    assert str(bad.parent) in capsys.readouterr().err


def test_a_planted_symlink_is_refused_and_its_target_untouched(tmp_path, capsys):
    """In a world-writable folder, a symlink planted at the dashboard's name (or at the old
    fixed temp name) must not make install write another file."""
    session, folder = ray_session(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (folder / grafana.DASHBOARD_FILE).symlink_to(victim)
    (folder / f".{grafana.DASHBOARD_FILE}.tmp").symlink_to(victim)  # the old fixed temp name
    assert cli.main(["grafana", "install", "--session-dir", str(session)]) == 2
    assert "symbolic link" in capsys.readouterr().err
    assert victim.read_text() == "precious"
    (folder / grafana.DASHBOARD_FILE).unlink()
    path = grafana.install(str(session))
    assert victim.read_text() == "precious" and not path.is_symlink()
    assert json.loads(path.read_text())["uid"] == DASHBOARD_UID
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    left = sorted(p.name for p in folder.iterdir())  # no temp file left behind
    assert left == sorted([f".{grafana.DASHBOARD_FILE}.tmp", grafana.DASHBOARD_FILE,
                           "default_grafana_dashboard.json"])  # fmt: skip
