"""A loop config's component records and their flat keywords (#66 item 1).

Each component's settings are one record declared and checked in its own module
(``CheckpointOptions``, ``EvalOptions``, ``ParallelOptions``); the configs take each
setting by its flat keyword too, through one table derived from the records, read them
back by that name, and ``dataclasses.replace`` changes them either way."""

import dataclasses
import inspect
import pickle

import pytest

import leantrain as lt
from leantrain.training.loops.config import run_config
from leantrain.training.loops.settings import FLAT


def test_a_setting_given_flat_or_in_its_record_is_the_same_config(tmp_path):
    flat = lt.LoaderTrainConfig(epochs=2, checkpoint_path=tmp_path / "ck", checkpoint_every=5, eval_data=[1, 2],
                                eval_every=3, eval_every_epochs=None, sharding="optimizer", shard_by="slot")
    records = lt.LoaderTrainConfig(epochs=2, checkpoints=lt.CheckpointOptions(path=tmp_path / "ck", every=5),
                                   evaluation=lt.EvalOptions(data=[1, 2], every=3),
                                   parallel=lt.ParallelOptions(sharding="optimizer", shard_by="slot"))
    assert flat == records
    assert flat.checkpoints.every == flat.checkpoint_every == 5
    assert flat.evaluation.every == flat.eval_every == 3 and flat.parallel.shard_by == flat.shard_by == "slot"
    assert isinstance(lt.TrainConfig(steps=1).checkpoints, lt.CheckpointOptions)  # always set


def test_replace_changes_a_setting_either_way_and_keeps_the_rest(tmp_path):
    cfg = lt.TrainConfig(steps=3, checkpoint_path=tmp_path / "ck", checkpoint_every=2, eval_data=[1], eval_every=1)
    moved = dataclasses.replace(cfg, checkpoint_every=4)
    assert moved.checkpoints == dataclasses.replace(cfg.checkpoints, every=4)
    assert moved.evaluation == cfg.evaluation and moved.steps == 3
    swapped = dataclasses.replace(cfg, evaluation=lt.EvalOptions(data=[2], every=2))
    assert swapped.eval_data == [2] and swapped.eval_every == 2 and swapped.checkpoints == cfg.checkpoints
    assert cfg.checkpoint_every == 2  # the original is untouched (frozen)
    back = pickle.loads(pickle.dumps(moved))  # a config travels to spawned ranks
    assert back == moved and back.checkpoint_every == 4


def test_two_values_for_one_setting_are_refused_naming_both(tmp_path):
    with pytest.raises(lt.ConfigError, match=r"TrainConfig: checkpoint_every=3 and checkpoints.every=5: give it one way"):
        lt.TrainConfig(steps=1, checkpoint_every=3, checkpoints=lt.CheckpointOptions(path=tmp_path / "c", every=5))
    same = lt.TrainConfig(steps=1, checkpoint_every=5, checkpoints=lt.CheckpointOptions(path=tmp_path / "c", every=5))
    assert same.checkpoint_every == 5
    with pytest.raises(lt.ConfigError, match="TrainConfig: checkpoints must be a leantrain CheckpointOptions"):
        lt.TrainConfig(steps=1, checkpoints={"every": 5})


def test_a_records_own_check_speaks_as_the_config_and_loader_settings_stay_loaders():
    with pytest.raises(lt.ConfigError, match="^TrainConfig: checkpoint_every=2 needs a checkpoint_path"):
        lt.TrainConfig(steps=1, checkpoint_every=2)
    with pytest.raises(lt.ConfigError, match="^LoaderTrainConfig: collective_timeout must be seconds"):
        lt.LoaderTrainConfig(epochs=1, collective_timeout=-1)
    with pytest.raises(TypeError, match="eval_every_epochs"):
        lt.TrainConfig(steps=1, eval_every_epochs=2)
    with pytest.raises(lt.ConfigError, match="TrainConfig: evaluation.every_epochs is for loader loops"):
        lt.TrainConfig(steps=1, evaluation=lt.EvalOptions(data=[1], every_epochs=2))
    assert not hasattr(lt.TrainConfig(steps=1), "eval_every_epochs")
    with pytest.raises(AttributeError, match="no attribute 'checkpoint_evry'"):
        lt.TrainConfig(steps=1).checkpoint_evry


def test_the_flat_keywords_are_in_the_signature_and_the_recorded_settings():
    params = inspect.signature(lt.LoaderTrainConfig).parameters
    assert set(FLAT) <= set(params) and params["checkpoint_every"].default == 0
    assert "eval_every_epochs" not in inspect.signature(lt.TrainConfig).parameters
    recorded = run_config(lt.TrainConfig(steps=1, eval_every=2, eval_data=[1, 2]))
    assert recorded["eval_every"] == 2 and recorded["checkpoint_every"] == 0 and recorded["sharding"] is None
    assert "checkpoints" not in recorded and "eval_every_epochs" not in recorded
