"""The public surface: the seed names, in snake_case, importable from the top level."""

import leantrain as lt
from leantrain import optim


def test_top_level_names():
    expected = {
        "optim", "Param", "ParamList", "Storage", "ParameterSchema",
        "canonical_gradients", "canonical_gradient", "add_gradient_packs", "scale_gradient_pack",
        "Runner", "Dataset", "DataLoader", "TrainConfig", "LoaderTrainConfig", "TrainReport",
        "CheckpointOptions", "EvalOptions", "ParallelOptions",  # a config's settings grouped by component
        "DDP",  # torch's DistributedDataParallel as the engine, with its options (#69)
        "FSDP2",  # torch's fully_shard as the engine, with its options (#69)
        "mean_gradients", "mean_loss_and_gradients", "step_batch", "step_batch_and_loss",
        "run_sample_steps", "train_samples", "train_dataset", "run_loader_epochs", "train_loader",
        "StepEvent", "save_checkpoint", "load_checkpoint", "read_checkpoint", "Checkpoint",
        "LeantrainError", "PackError", "PackTypeError", "AliasError", "ConfigError",
        "OptimizerStateError", "DataError", "CheckpointError", "NonFiniteError", "CollectiveError", "ReplicaError",
        "__version__",
        # deliberately added: evaluation, callbacks, and the file modules as attributes
        "evaluate", "metrics", "Callback", "EarlyStopping", "Averaging", "label_smoothed", "ProgressBar", "JSONLLogger", "CSVLogger",
        "TensorBoardLogger", "weights", "torchlean_io", "check", "CheckReport",
        "LossSum", "collate", "split_rows",  # token-weighted losses, ready collate functions, cutting rows
        # run management: trackers, per-item outputs, the learning-rate range test, seeding
        "WandbLogger", "MLflowLogger", "predict", "find_lr", "LRFinderResult", "find_batch_size", "BatchSizeResult", "seed_everything",
    }
    assert set(lt.__all__) == expected
    for name in expected:
        assert hasattr(lt, name), name


def test_param_list_methods_from_the_seed():
    for name in ("of_pack", "of_pack_with_requires_grad", "from_module", "requires_grad_array",
                 "optimizer_storage", "canonical_slot_indices", "values", "values_synced", "set_values"):
        assert callable(getattr(lt.ParamList, name)), name


def test_optim_constructors_and_schedules():
    for name in ("sgd", "adagrad", "rmsprop", "adam", "adamw", "adadelta", "lion",
                 "constant", "step", "exponential", "warmup_cosine"):
        assert callable(getattr(optim, name)), name


def test_errors_subclass_the_builtins():
    assert issubclass(lt.PackError, ValueError) and issubclass(lt.PackTypeError, TypeError)
    assert all(issubclass(e, lt.LeantrainError) for e in (lt.ConfigError, lt.CheckpointError, lt.DataError,
                                                          lt.CollectiveError, lt.ReplicaError))
