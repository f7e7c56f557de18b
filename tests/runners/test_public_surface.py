"""A runner's public names are the reference's documented names plus a short, reasoned list of our own.

A user's subclass inherits every public name of its runner, so each one is a promise: a documented
hook, a documented attribute or a documented method. The names below that the API reference of
the original DanLing documents for its runner classes are kept for compatibility; every other public
name must be entered in `DANLING_OWN` with the reason it is public (a backend hook, a user hook the
reference lacks, ...). A new public name fails this test until it is entered here deliberately, and
an entry whose name no runner has any more fails it too, so the list stays the true surface.
"""

from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path

import pytest

from danling.runners import BaseRunner, DeepSpeedRunner, GraphRunner, ParallelRunner, TorchRunner

RUNNERS = (BaseRunner, TorchRunner, ParallelRunner, DeepSpeedRunner, GraphRunner)
DOCS = Path(__file__).resolve().parents[2] / "docs"

# Names the reference documents on its runner classes (members, attribute tables and the prose of
# the hook contracts), for any of the four classes.
REFERENCE = frozenset(
    [
        "accum_steps",
        "all_reduce",
        "apply_activation_checkpointing",
        "auto_restore",
        "backward",
        "batch_size",
        "best_index",
        "best_result",
        "best_score",
        "build_dataloaders",
        "build_datasampler",
        "build_optimizer",
        "build_pipeline_model_part",
        "build_pipeline_model_parts",
        "build_pipeline_schedule",
        "build_scheduler",
        "build_topology",
        "checkpoint_interval",
        "close",
        "code_id",
        "collate_fn",
        "compiler",
        "config",
        "config_id",
        "criterion",
        "deepspeed_config",
        "device",
        "dir",
        "distributed",
        "elastic_state",
        "ema",
        "epochs",
        "evaluate",
        "evaluate_epoch",
        "evaluate_splits",
        "evaluate_step",
        "evaluate_steps",
        "forward_context",
        "fp8_enabled",
        "from_checkpoint",
        "from_pretrained",
        "get_deepspeed_config",
        "id",
        "infer",
        "infer_step",
        "init_checkpoint_manager",
        "init_distributed",
        "init_fault_tolerance",
        "init_garbage_collection",
        "init_heartbeat",
        "init_signal_handlers",
        "init_tensorboard",
        "init_wandb",
        "is_best",
        "is_local_main_process",
        "is_main_process",
        "is_step_mode",
        "iter_optimizer_named_parameters",
        "iter_optimizer_parameters",
        "latest_result",
        "latest_score",
        "load_checkpoint",
        "load_dataloaders",
        "load_ema",
        "load_model",
        "load_optimizer",
        "load_pretrained",
        "load_scheduler",
        "load_state_dict",
        "local_rank",
        "log_interval",
        "materialize_model",
        "max_grad_norm",
        "max_grad_value",
        "metrics",
        "mode",
        "model",
        "model_parts",
        "optimizer",
        "optimizer_container",
        "optimizer_step",
        "parallel",
        "parallelize_model",
        "patience",
        "pipeline_has_first_stage",
        "pipeline_has_last_stage",
        "pipeline_schedule",
        "pipeline_stage_indices",
        "precision",
        "prepare_for_shutdown_checkpoint",
        "progress",
        "rank",
        "read_checkpoint",
        "read_config",
        "reduce",
        "reduce_loss_for_logging",
        "results",
        "rng_state",
        "save",
        "save_checkpoint",
        "save_seed_checkpoint",
        "scheduler",
        "scheduler_interval",
        "scheduler_monitor",
        "score_split",
        "scores",
        "set_checkpoint_manager",
        "set_deterministic",
        "set_seed",
        "setup_fp8",
        "skip_nonfinite_grad",
        "split",
        "state",
        "state_dict",
        "step",
        "steps",
        "to_device",
        "topology",
        "train",
        "train_context",
        "train_epoch",
        "train_epochs",
        "train_splits",
        "train_state",
        "train_step",
        "train_steps",
        "unwrap",
        "world_size",
    ]
)

# danling's own public names, each with why it is public rather than private.
DANLING_OWN = {
    # Hooks a user may override that the reference does not name.
    "advance_schedulers": "user hook: steps epoch-wise and metric schedulers once per round",
    "checkpoint_save_failed": "user hook: reacts to a failed background save",
    "collect_result": "user hook: builds a split's result row from its meters and metrics",
    "inference_context": "user hook: the context inference steps run under",
    "update_metrics": "user hook: feeds a step's output and target to the split's metrics",
    "loss_weight": "user hook: the weight of a step's loss in the pass's loss (its samples, or tokens)",
    "log_values": "called method: sends user values to the trackers",
    # Attributes a user sets or reads.
    "train_metrics": "attribute: metrics of training splits when they differ from evaluation's",
    "evaluate_metrics": "attribute: metrics of evaluation splits when they differ from training's",
    "evaluate_interval": "attribute: the evaluation cadence of step mode, from the config",
    "supported_features": "class attribute: the config features a backend implements (lifts their refusal)",
    "unsupported_features": "class attribute: features of its bases a backend gives up (their keys are refused)",
    # Hooks backends override or call: public so that backends use no private name (lint test).
    "build_update_strategy": "backend hook: the update strategy of this backend",
    "apply_train_timeout": "backend hook: arms the per-step timeout around the update",
    "require_model": "backend hook: refuses a runner built without a model",
    "materialize_ema": "backend hook: builds the EMA copy after the model is materialized",
    "checkpoint_options": "backend hook: manager options of the checkpoint section",
    "checkpointing_class": "class attribute: the checkpointing component a backend builds (its own subclass)",
    "replicated_tensors": "backend hook: what replicas must hold identically (consistency sentinel; ZeRO differs)",
    # Backend-specific attributes and methods.
    "pipeline": "ParallelRunner attribute: the pipeline steps component",
    "pipeline_stages": "ParallelRunner attribute: this rank's pipeline stages",
    "engine_owns_scheduler": "DeepSpeedRunner attribute: whether the engine steps the scheduler",
    "export_consolidated": "DeepSpeedRunner method: writes a consolidated model file from ZeRO shards",
    "model_state_dict": "DeepSpeedRunner method: the model's full state dict from the engine",
    # Precision and telemetry.
    "apply_fp8": "backend hook: converts a model (part) to float8 before compiling, sharding and wrapping",
    "fp8": "attribute: the float8 policy of `precision: fp8` (None otherwise)",
    "telemetry": "attribute: the TFLOP/s and MFU counter of the training step logs",
    "compiled_step": "GraphRunner attribute: the compiled training step and the graph breaks it saw",
    "compile_artifacts": "GraphRunner attribute: the compiler cache artifacts saved and loaded across launches",
}


def public_names(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize("runner_cls", RUNNERS, ids=lambda cls: cls.__name__)
def test_every_public_name_is_documented_by_the_reference_or_listed_with_a_reason(runner_cls: type) -> None:
    unlisted = sorted(public_names(runner_cls) - REFERENCE - set(DANLING_OWN))
    assert not unlisted, (
        f"{runner_cls.__name__} has public names that are neither the reference's nor in DANLING_OWN: {unlisted}; "
        "make them private, move them onto a component, or enter them with the reason they are public"
    )


def test_no_stale_entries() -> None:
    everywhere = set().union(*(public_names(cls) for cls in RUNNERS))
    stale = sorted(set(DANLING_OWN) - everywhere)
    assert not stale, f"DANLING_OWN lists names no runner has: {stale}"


@pytest.mark.parametrize("runner_cls", RUNNERS, ids=lambda cls: cls.__name__)
def test_every_public_attribute_is_documented(runner_cls: type) -> None:
    """Properties carry a docstring; plain class attributes are described in a class docstring or the docs."""
    docs_text = "\n".join(path.read_text(encoding="utf-8") for path in DOCS.rglob("*.md"))
    class_docs = "\n".join(klass.__doc__ or "" for klass in runner_cls.__mro__)
    undocumented = []
    for name in sorted(public_names(runner_cls)):
        raw = inspect.getattr_static(runner_cls, name)
        if isinstance(raw, (classmethod, staticmethod)) or (callable(raw) and not isinstance(raw, type)):
            continue  # methods: tests/runners/test_hook_contracts.py holds them to their contracts
        if isinstance(raw, (property, functools.cached_property)) and (raw.__doc__ or "").strip():
            continue
        mentioned = re.compile(rf"(^|\s){name}:|`{name}`|\.{name}\b", re.MULTILINE)
        if not (mentioned.search(class_docs) or mentioned.search(docs_text)):
            undocumented.append(name)
    assert not undocumented, f"{runner_cls.__name__} attributes without documentation: {undocumented}"
