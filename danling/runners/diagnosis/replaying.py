"""Re-running a replay bundle on one process, and finding where its first non-finite value appears.

[`replay_bundle`][danling.runners.diagnosis.replaying.replay_bundle] (the `danling replay BUNDLE`
command) verifies the bundle against its manifest, rebuilds the runner from the class and the
config the bundle names (on one process, in a scratch workspace, with `replay.*` off), loads the
state the update started from (the copied state, or the checkpoint plus the updates since), and
runs the update's micro-batches through the runner's own `train_step` with the RNG states of the
run. Hooks on every module (and the criterion, when it is one) report the first non-finite value:
a module's output in the forward pass, or the gradient a module's backward produced (of its input
or of one of its parameters) in the backward pass. The replayed losses are compared with the
run's, bit for bit.

Loading a bundle unpickles its batches and builds the runner it names: replay only bundles you trust.
"""

from __future__ import annotations

import importlib
import json
import math
import runpy
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from .replay import BUNDLE_FORMAT, _sha256, restore_rng

__all__ = ["Bundle", "BundleError", "Finding", "ReplayHost", "ReplayReport", "load_bundle", "replay_bundle"]


class BundleError(ValueError):
    """A bundle that cannot be replayed: missing, changed or unreadable files, or a runner that cannot be built."""


class ReplayHost(Protocol):
    """What a replay uses of the runner it builds."""

    model: Any
    criterion: Any
    update: Any

    def unwrap(self, model: Any) -> Any: ...
    def train_step(self, data: Any) -> tuple[Any, Any]: ...
    def optimizer_step(self) -> bool: ...
    def read_checkpoint(self, checkpoint: Any) -> Mapping[str, Any]: ...
    def load_model(self, state_dict: Mapping[str, Any]) -> None: ...
    def load_optimizer(self, state_dict: Mapping[str, Any] | None) -> None: ...
    def load_scheduler(self, state_dict: Mapping[str, Any] | None) -> None: ...
    def close(self) -> None: ...


@dataclass
class Bundle:
    """A verified bundle: its `manifest`, the run's `config`, the copied `state` (copy mode) and the `windows`."""

    path: Path
    manifest: dict[str, Any]
    config: dict[str, Any]
    state: dict[str, Any] | None
    windows: list[dict[str, Any]]


@dataclass(frozen=True)
class Finding:
    """Where the first non-finite value appeared.

    Attributes:
        phase: `state` (already in the weights before the update), `input` (in the batch),
            `forward`, `backward` or `loss`.
        module: Qualified name of the module (`criterion` for the runner's criterion; `None` for the batch).
        tensor: Which tensor: `output`, `output[0]`, `grad_input[0]`, `weight.grad`, `batch[0]`, ...
        micro_batch: Index of the micro-batch in the update (`None` for `state`).
        detail: What came into the module (finite or not), in words.
    """

    phase: str
    module: str | None
    tensor: str
    micro_batch: int | None
    detail: str = ""

    def __str__(self) -> str:
        where = f"module `{self.module}`" if self.module is not None else "the batch"
        batch = "" if self.micro_batch is None else f", micro-batch {self.micro_batch}"
        detail = f"; {self.detail}" if self.detail else ""
        return f"{self.phase} of {where}: {self.tensor}{batch}{detail}"


@dataclass
class ReplayReport:
    """What a replay found.

    Attributes:
        bundle: The bundle's directory; manifest: its manifest.
        updates: Updates run (the checkpoint-mode ones before the bundled one included).
        losses: Losses of the bundled update's micro-batches, replayed; recorded: the run's.
        identical: Whether the replayed losses (of every update run) equal the run's bit for bit.
        finding: The first non-finite value (`None`: every value was finite).
        error: The error the replayed update raised (the non-finite check's, say), in words.
        notes: Differences from the run that may matter (another code version, another torch).
    """

    bundle: str
    manifest: dict[str, Any]
    updates: int = 0
    losses: list[float | None] = field(default_factory=list)
    recorded: list[float | None] = field(default_factory=list)
    identical: bool = True
    finding: Finding | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """The report in words, one fact a line."""
        m = self.manifest
        code = (m.get("code") or {}).get("code_id") or "unknown"
        same = "bit for bit the same" if self.identical else "DIFFERENT from the run"
        if all(loss is None for loss in self.recorded):
            same = "the run's step raised before it returned its loss: not compared"
        lines = [
            f"bundle:   {self.bundle}",
            f"recorded: global step {m['step']} on rank {m['rank']} of {m['world_size']}, reason {m['reason']}, "
            f"{m['mode']} mode, code {code}" + (f" ({m['error']})" if m.get("error") else ""),
            f"replayed: {self.updates} update(s) on one process; the last one has {len(self.losses)} micro-batch(es)",
            f"losses:   {_floats(self.losses)} (run: {_floats(self.recorded)}): {same}",
        ]
        if self.finding is None:
            lines.append("first non-finite: none; every output and gradient of this rank's micro-batches is finite")
            if m["reason"] == "nonfinite":
                lines.append("          (the non-finite value arose on another rank: replay its bundle)")
        else:
            lines.append(f"first non-finite: {self.finding}")
        if self.error:
            lines.append(f"error:    {self.error}")
        lines.extend(f"note:     {note}" for note in self.notes)
        return lines

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["finding"] = None if self.finding is None else asdict(self.finding)
        return data


def load_bundle(path: str | Path) -> Bundle:
    """Read a bundle and verify each file against the SHA-256 its manifest records.

    Raises:
        BundleError: `path` is no bundle, a file is missing, changed or unreadable (the message names it).
    """
    root = Path(path)
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        why = "does not exist" if not root.exists() else "has no manifest.json"
        raise BundleError(f"{root} {why}: not a replay bundle (runs write them under <run dir>/replay/)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        raise BundleError(f"{manifest_path} is not readable JSON ({error}); the bundle is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise BundleError(f"{manifest_path}: bundle format {found!r}, this danling reads format {BUNDLE_FORMAT}")
    files = manifest.get("files") or {}
    required = {"config.json", "windows.pt"} | ({"state.pt"} if manifest.get("mode") == "copy" else set())
    for name in sorted(required | set(files)):
        file = root / name
        if not file.is_file():
            raise BundleError(f"replay bundle {root}: {name} is missing (the bundle is incomplete)")
        if name not in files or _sha256(file) != files[name]:
            raise BundleError(
                f"replay bundle {root}: {name} does not match the SHA-256 in manifest.json (changed or truncated)"
            )
    try:
        config = json.loads((root / "config.json").read_text())
        windows = _load(root / "windows.pt")["windows"]
        state = _load(root / "state.pt") if "state.pt" in files else None
    except BundleError:
        raise
    except Exception as error:
        raise BundleError(f"replay bundle {root}: cannot read it ({type(error).__name__}: {error})") from None
    if not windows:
        raise BundleError(f"replay bundle {root}: windows.pt holds no update to replay")
    return Bundle(root, manifest, config, state, windows)


def replay_bundle(path: str | Path, workdir: str | Path | None = None) -> ReplayReport:
    """Re-run the bundled update on this process and report where its first non-finite value appears.

    Args:
        path: The bundle directory (`<run dir>/replay/step-...`).
        workdir: Workspace root of the rebuilt runner (default: a temporary directory, removed after).

    Raises:
        BundleError: The bundle is damaged or its runner cannot be built (the message says which).
    """
    bundle = load_bundle(path)
    runner_class = _runner_class(bundle.manifest)
    with tempfile.TemporaryDirectory(prefix="danling-replay-") as scratch:
        config = _replay_config(bundle.config, workdir if workdir is not None else scratch)
        try:
            runner = runner_class(config)
        except Exception as error:
            name = bundle.manifest["runner"]
            why = f"{type(error).__name__}: {error}"
            raise BundleError(f"cannot build {name} from the bundle's config ({why})") from None
        try:
            return _replay(runner, bundle)
        finally:
            runner.close()


def _replay(runner: ReplayHost, bundle: Bundle) -> ReplayReport:
    report = ReplayReport(str(bundle.path), bundle.manifest, notes=_notes(bundle.manifest))
    _restore(runner, bundle)
    *before, last = bundle.windows
    for window in before:  # checkpoint mode: the updates between the checkpoint and the bundled one
        losses, _ = _run_window(runner, window)
        report.identical &= _same(losses, window["losses"])
        report.updates += 1
    probe = NonFiniteProbe(runner)
    report.finding = probe.check_state()
    with probe, warnings.catch_warnings():
        # A module whose inputs need no gradient (the first layer) has its backward hook called with
        # the gradient of its output; torch warns about it, and that is all this probe needs.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        losses, report.error = _run_window(runner, last, probe)
    report.updates += 1
    report.finding = report.finding or probe.finding
    report.losses, report.recorded = _values(losses), _values(last["losses"])
    report.identical &= _same(losses, last["losses"])
    return report


class NonFiniteProbe:
    """Forward and backward hooks on every module that remember the first non-finite value (see `Finding`)."""

    def __init__(self, runner: ReplayHost) -> None:
        self.model = runner.unwrap(runner.model)
        self.criterion = runner.criterion if isinstance(runner.criterion, nn.Module) else None
        self.finding: Finding | None = None
        self.micro_batch = 0
        self.loss: torch.Tensor | None = None  # the criterion's latest output (when it is a module)
        self._handles: list[Any] = []

    def _modules(self):
        yield from ((name or "<model>", module) for name, module in self.model.named_modules())
        if self.criterion is not None:
            yield "criterion", self.criterion

    def check_state(self) -> Finding | None:
        """The first non-finite weight, buffer or optimizer value before the update (`None`: all finite)."""
        for name, module in self._modules():
            for key, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    return Finding("state", name, key, None, "the weights were already non-finite before this update")
        return None

    def __enter__(self) -> NonFiniteProbe:
        for name, module in self._modules():
            self._handles.append(module.register_forward_hook(partial(self._forward, name)))
            self._handles.append(module.register_full_backward_hook(partial(self._backward, name)))
            for key, parameter in module.named_parameters(recurse=False):
                if parameter.requires_grad:
                    hook = partial(self._gradient, name, key)
                    self._handles.append(parameter.register_post_accumulate_grad_hook(hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def check_batch(self, batch: Any) -> None:
        if self.finding is None and (bad := _first_bad(batch, "batch")) is not None:
            self.finding = Finding("input", None, bad, self.micro_batch, "the micro-batch itself is not finite")

    def _forward(self, name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        if module is self.criterion and isinstance(output, torch.Tensor):
            self.loss = output.detach()
        if self.finding is not None or (bad := _first_bad(output, "output")) is None:
            return
        came = _first_bad(inputs, "input")
        detail = "its inputs were finite" if came is None else f"its {came} was already non-finite"
        self.finding = Finding("forward", name, bad, self.micro_batch, detail)

    def _backward(self, name: str, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        if self.finding is not None or (bad := _first_bad(grad_input, "grad_input")) is None:
            return
        came = _first_bad(grad_output, "grad_output")
        detail = (
            "the gradient of its output was finite"
            if came is None
            else f"its {came} was already non-finite (the loss, or code outside the modules)"
        )
        self.finding = Finding("backward", name, bad, self.micro_batch, detail)

    def _gradient(self, name: str, key: str, parameter: torch.Tensor) -> None:
        grad = parameter.grad
        if self.finding is None and grad is not None and not bool(torch.isfinite(grad).all()):
            detail = "the gradient of this parameter is the first non-finite one"
            self.finding = Finding("backward", name, f"{key}.grad", self.micro_batch, detail)


def _run_window(runner: ReplayHost, window: Mapping[str, Any], probe: NonFiniteProbe | None = None):
    """Run one update's micro-batches through `train_step` from its RNG states; (losses, error in words)."""
    restore_rng(window["rng"])
    batches: Sequence[Any] = window["batches"]
    runner.update.start_pass(len(batches))
    losses: list[Any] = []
    try:
        for index, batch in enumerate(batches):
            if probe is not None:
                probe.micro_batch = index
                probe.check_batch(batch)
                probe.loss = None
            try:
                _, loss = runner.train_step(batch)
            except Exception:
                # The update failed after the forward pass (the non-finite check stopping the run,
                # say): the loss is the criterion's output the probe saw, when it saw one.
                losses.append(None if probe is None else probe.loss)
                raise
            losses.append(loss)
        if runner.update.close_window():
            runner.optimizer_step()
    except Exception as error:  # the hooks have seen what led to it
        return losses, f"{type(error).__name__}: {' '.join(str(error).split())}"
    return losses, None


def _restore(runner: ReplayHost, bundle: Bundle) -> None:
    """Load the state the bundled updates start from: the copy, or the checkpoint it names."""
    state = bundle.state
    if state is None:
        checkpoint = bundle.manifest.get("checkpoint")
        if checkpoint is None:
            return  # no checkpoint before it: the run started from the state its config builds
        if not Path(checkpoint).exists():
            raise BundleError(f"replay bundle {bundle.path}: its checkpoint {checkpoint} does not exist any more")
        state = dict(runner.read_checkpoint(checkpoint))
    runner.load_model(state["model"])
    runner.load_optimizer(state.get("optimizer"))
    if state.get("scheduler") is not None:
        runner.load_scheduler(state["scheduler"])


def _runner_class(manifest: Mapping[str, Any]) -> type:
    name = manifest.get("runner") or ""
    module, _, qualname = name.partition(":")
    try:
        if module == "__main__":
            script = manifest.get("script")
            if not script:
                raise ImportError("the runner was defined in __main__ and the bundle names no script")
            namespace: Any = runpy.run_path(script, run_name="__danling_replay__")
            target = namespace[qualname.split(".")[0]]
            parts = qualname.split(".")[1:]
        else:
            target, parts = importlib.import_module(module), qualname.split(".")
        for part in parts:
            target = getattr(target, part)
    except Exception as error:
        raise BundleError(
            f"cannot import the runner class {name!r} the bundle names ({type(error).__name__}: {error}); "
            "run `danling replay` where the run's code is importable (PYTHONPATH)"
        ) from None
    return target


def _replay_config(config: Mapping[str, Any], root: str | Path) -> dict[str, Any]:
    """The run's config on one process in a scratch workspace: nothing resumed, logged or bundled."""
    replayed = dict(config)
    replayed.update(workspace_root=str(root), resume=None, auto_resume=False, log=False)
    replayed["replay"] = {**dict(config.get("replay") or {}), "on_nonfinite": False, "on_rollback": False}
    replayed["replay"]["capture_steps"] = []
    return replayed


def _notes(manifest: Mapping[str, Any]) -> list[str]:
    from ..services.git_info import git_info

    notes = []
    recorded = ((manifest.get("code") or {}).get("git") or {}).get("commit")
    current = (git_info() or {}).get("commit")
    if recorded and current and recorded != current:
        notes.append(f"the run's code was commit {recorded[:12]}, this process runs {current[:12]}")
    if manifest.get("torch") != torch.__version__:
        notes.append(f"the run used torch {manifest.get('torch')}, this process torch {torch.__version__}")
    return notes


def _load(path: Path) -> Any:
    # Batches are arbitrary objects: a bundle is trusted like the code it replays (see the module docs).
    return torch.load(path, map_location="cpu", weights_only=False)


def _first_bad(value: Any, path: str) -> str | None:
    """The path of the first floating tensor in `value` holding NaN/inf (`None`: all finite)."""
    if isinstance(value, torch.Tensor):
        if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
            return path
        return None
    if isinstance(value, tuple) and len(value) == 1 and path in ("input", "grad_input", "grad_output"):
        items = [(path, value[0])]  # a module's usual single input: `input`, not `input[0]`
    elif isinstance(value, Mapping):
        items = [(f"{path}[{key!r}]", item) for key, item in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{index}]", item) for index, item in enumerate(value)]
    else:
        return None
    for where, item in items:
        if (bad := _first_bad(item, where)) is not None:
            return bad
    return None


def _values(losses: Sequence[Any]) -> list[float | None]:
    return [None if loss is None else float(torch.as_tensor(loss).float().mean()) for loss in losses]


def _same(replayed: Sequence[Any], recorded: Sequence[Any]) -> bool:
    """Bit for bit (NaN equals NaN); a loss the run did not record compares equal."""
    if len(replayed) != len(recorded):
        return False
    for mine, theirs in zip(replayed, recorded):
        if mine is None or theirs is None:
            continue
        a, b = (torch.as_tensor(x).detach().cpu().reshape(-1).contiguous() for x in (mine, theirs))
        if a.dtype != b.dtype or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            return False
    return True


def _floats(values: Sequence[float | None]) -> str:
    shown = ["-" if v is None else ("nan" if math.isnan(v) else f"{v:.8g}") for v in values]
    return " ".join(shown) or "-"
