"""Which Ray ``ray-dhp train`` uses (``run.ray_address``), what Ctrl-C says, and the
placement-group cleaner that asks its own cluster (`ray_dhp.train.pg_cleaner`). Ray is not
started here: ``ray.init`` is recorded."""

import os
import tempfile

import pytest
import ray

from ray_dhp.cli import train as cli_train
from ray_dhp.run_file import load_run_file


@pytest.fixture
def inits(monkeypatch):
    calls = []

    def fake_init(address=None, **kwargs):
        calls.append({"address": address, "RAY_ADDRESS": os.environ.get("RAY_ADDRESS"),
                      "TMPDIR": os.environ.get("TMPDIR"), **kwargs})

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cli_train.atexit, "register", lambda fn, *a: None)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(cli_train, "running_cluster", lambda: "10.0.0.1:6379")  # a `ray start`
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_local_is_private_beside_any_cluster(inits, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    cli_train.init_ray(load_run_file(None, ["run.ray_address=local", "run.num_cpus=3"]), 2)
    (call,) = inits
    own_tmp = call.pop("TMPDIR")  # the private Ray's processes get a temp folder of their own
    assert os.path.dirname(own_tmp) == tempfile.gettempdir() and "ray_dhp_local_" in own_tmp
    assert call == {"address": "local", "RAY_ADDRESS": None, "num_cpus": 3,
                    "_temp_dir": os.path.join(tempfile.gettempdir(), "ray")}  # logs as usual
    assert os.environ["RAY_ADDRESS"] == "10.0.0.2:6379"  # given back
    assert os.environ["TMPDIR"] == str(tmp_path)
    cli_train._close_private_ray(own_tmp)  # Ray not running here: the folder goes
    assert not os.path.exists(own_tmp)


def test_default_joins_and_an_address_is_followed(inits, monkeypatch, capsys):
    cli_train.init_ray(load_run_file(None), 2)
    assert inits[-1]["address"] == "10.0.0.1:6379"
    assert "run.ray_address=local" in capsys.readouterr().out  # says how to stay private
    cli_train.init_ray(load_run_file(None, ["run.ray_address=10.0.0.3:6379"]), 2)
    assert inits[-1]["address"] == "10.0.0.3:6379"
    monkeypatch.setattr(cli_train, "running_cluster", lambda: None)
    cli_train.init_ray(load_run_file(None), 2)
    assert inits[-1]["address"] == "local"


def test_interrupt_hint_says_how_to_resume():
    rf = load_run_file(None, ["checkpoint.checkpoint_every=5", "run.name=mine"])
    assert cli_train.interrupt_hint(rf, named=True) == (
        "interrupted. Run the same command again to resume run 'mine' from its last checkpoint "
        "(written every 5 steps).")
    rf = load_run_file(None, ["checkpoint.checkpoint_every=5"])
    assert f"again with run.name={rf.run_name()}" in cli_train.interrupt_hint(rf, named=False)
    assert "afresh" in cli_train.interrupt_hint(load_run_file(None), named=True)


def test_the_trainer_swaps_in_the_cluster_cleaner():
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback)

    from ray_dhp.train.pg_cleaner import ClusterCleanerCallback, with_cluster_cleaner

    out = with_cluster_cleaner([PlacementGroupCleanerCallback(), "other"])
    assert type(out[0]) is ClusterCleanerCallback and out[1] == "other"


def test_sigterm_does_what_ctrl_c_does_while_training():
    import signal

    seen = []
    before_int = signal.signal(signal.SIGINT, lambda s, f: seen.append(s))  # Ray Train's, in fit()
    try:
        before = signal.getsignal(signal.SIGTERM)
        with cli_train.sigterm_as_sigint():
            signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGINT]
        assert signal.getsignal(signal.SIGTERM) is before  # given back after training
    finally:
        signal.signal(signal.SIGINT, before_int)
