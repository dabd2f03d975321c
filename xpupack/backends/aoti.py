"""The AOTInductor backend: each recorded signature exported (`torch.export`) and compiled ahead of time
into a shared library, which a load maps in and runs at once: no tracing, no compile, no Dynamo, no
pickle and no thread in the loading process.

The library is compiled without the weights; a load hands it the module's own parameters and buffers as
user-managed constants (no copy), and hands them again when the module's storages change (`StorageWatch`).
A call's state objects (a StaticCache) go in as their tensors, which the library updates in place, as the
module's own forward would (`xpupack.state.tensors_replaced`). The output is rebuilt from a layout learnt
while exporting: the module's output tree, each leaf a tensor the library returns, one of the call's state
objects, or a constant. AOTInductor checks no guards: which call runs which library stays the
dispatcher's fit check (`xpupack.tuned`), exact shapes, dtypes and devices.

The libraries are native code tied to the torch build and the machine's vector ISA (CPU) or architecture
(GPU): the trust rule applies (``compiled_artifacts``), and an untrusted or mismatched package compiles
here instead: at load for calls without state, at the first call of a signature with state (only a real
call brings a KV cache).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .. import _device, _torch_compat
from .._compare import LOW_PRECISION_SQNR_DB
from ..errors import error_line
from ..manifest import artifact_file
from ..module_spec import ModuleSpec, Target
from ..signature import ConstantLeaf, Signature, TensorLeaf, flatten, unflatten
from ..state import StateNotReady, state_type, tensors_replaced
from . import _facts
from ._facts import AOTI_DEPENDS_ON
from ._storage_watch import StorageWatch
from .base import Backend, Runner, register_backend

log = logging.getLogger(__name__)

#: the prefix the exported wrapper gives the module's parameters and buffers (`_Exported`)
_PREFIX = "module."
#: output leaf kinds of a `_Layout`
_TENSOR, _STATE, _CONSTANT = "tensor", "state", "constant"
_SIMPLE = (type(None), bool, int, float, str)


class NotExportable(Exception):
    """A signature AOTInductor cannot take; the message says why (the signature runs the original)."""


class _Layout:
    """How a call's output is rebuilt from the library's flat tensor outputs and the call's own leaves.

    ``leaves[k]`` is ``("tensor", i)`` (the library's output ``i``), ``("state", slot)`` (the call's state
    object at leaf ``slot``, which a forward returns as it came, e.g. ``past_key_values``) or
    ``("constant", value)``."""

    def __init__(self, tree: Any, leaves: list[tuple[str, Any]]):
        self.tree, self.leaves = tree, leaves
        self._fill = [(kind == _TENSOR, kind == _STATE, value) for kind, value in leaves]

    @classmethod
    def learn(cls, output: Any, call_leaves: list, state_slots: tuple[int, ...]) -> tuple[_Layout, list]:
        """The layout of ``output`` (traced), and the tensors the exported program returns, in order."""
        values, tree = pytree.tree_flatten(output)
        layout: list[tuple[str, Any]] = []
        tensors: list[torch.Tensor] = []
        for value in values:
            if isinstance(value, torch.Tensor):
                layout.append((_TENSOR, len(tensors)))
                tensors.append(value)
                continue
            slot = next((slot for slot in state_slots if call_leaves[slot] is value), None)
            if slot is not None:
                layout.append((_STATE, slot))
            elif isinstance(value, _SIMPLE):
                layout.append((_CONSTANT, value))
            else:
                raise NotExportable(f"its output holds a {type(value).__name__}, not a tensor or a state object")
        return cls(tree, layout), tensors

    def rebuild(self, outputs: list[torch.Tensor], call_leaves: list) -> Any:
        values = [
            outputs[value] if tensor else call_leaves[value] if state else value for tensor, state, value in self._fill
        ]
        return pytree.tree_unflatten(values, self.tree)

    def to_json(self) -> dict:
        return {"tree": pytree.treespec_dumps(self.tree), "leaves": [list(leaf) for leaf in self.leaves]}

    @classmethod
    def from_json(cls, data: Any, signature: Signature) -> _Layout:
        """Parses `to_json`'s output; raises ``ValueError`` on anything malformed. The tree may name only
        node types this process has registered already (a model's output class): parsing imports nothing."""
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("tree"), str)
            or not isinstance(data.get("leaves"), list)
        ):
            raise ValueError("an output layout must be an object with a 'tree' string and a 'leaves' list")
        _check_output_tree(data["tree"])
        try:
            tree = pytree.treespec_loads(data["tree"])
        except Exception as exc:  # treespec_loads raises many kinds on bad input
            raise ValueError(f"unreadable output tree: {error_line(exc)}") from None
        leaves: list[tuple[str, Any]] = []
        for leaf in data["leaves"]:
            if not (isinstance(leaf, list) and len(leaf) == 2 and leaf[0] in (_TENSOR, _STATE, _CONSTANT)):
                raise ValueError(f"malformed output leaf {str(leaf)[:80]}")
            kind, value = leaf
            if kind == _STATE and value not in signature.state_slots:
                raise ValueError(f"output leaf names input {value!r}, which holds no state object")
            if kind == _TENSOR and not (type(value) is int and value >= 0):
                raise ValueError(f"output leaf names output {value!r}")
            if kind == _CONSTANT and not isinstance(value, _SIMPLE):
                raise ValueError(f"output constant {str(value)[:80]} is not a plain value")
            leaves.append((kind, value))
        if tree.num_leaves != len(leaves):
            raise ValueError(f"the output tree has {tree.num_leaves} leaves but {len(leaves)} are described")
        return cls(tree, leaves)


def _check_output_tree(text: str) -> None:
    """The stored output tree names only node types registered in this process (torch's containers, a
    model's output class that its library registered), never one whose parsing would import a module."""
    try:
        _, root = json.loads(text)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ValueError(f"unreadable output tree: {exc}") from None
    pending, seen = [root], 0
    while pending:
        node = pending.pop()
        seen += 1
        if seen > 10_000 or not isinstance(node, dict) or not isinstance(node.get("children_spec"), list):
            raise ValueError("the output tree is malformed or larger than 10000 nodes")
        kind = node.get("type")
        if kind is not None and (kind not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE or "defaultdict" in kind):
            raise ValueError(f"output tree node type {kind!r} is not registered in this process")
        pending.extend(node["children_spec"])


class _Exported(nn.Module):
    """``forward(*tensors)``: one call of ``signature`` with its tensor leaves, then its state objects'
    tensors, as inputs; returns the output's tensors (the layout, learnt while tracing, says where the rest go).
    The module is a child, so its parameters and buffers are the program's constants (``module.<name>``)."""

    def __init__(self, target: Target, signature: Signature, leaves: list):
        super().__init__()
        self.module = target.module
        self.forward_of_module = target.forward
        self.signature, self.leaves = signature, leaves
        self.tensor_slots = [i for i, leaf in enumerate(signature.leaves) if isinstance(leaf, TensorLeaf)]
        learnt: list[_Layout] = []
        # export puts back whatever its trace changed in the module's attributes: the layout leaves by a closure
        self.learn = learnt.append
        self.learnt = lambda: learnt[-1] if learnt else None

    def forward(self, *tensors: torch.Tensor) -> tuple:
        leaves = list(self.leaves)
        for slot, tensor in zip(self.tensor_slots, tensors):
            leaves[slot] = tensor
        state = list(tensors[len(self.tensor_slots) :])
        with _state_as_inputs(self.signature, leaves, state):
            args, kwargs = unflatten(leaves, self.signature.tree)
            output = self.forward_of_module(*args, **kwargs)
        layout, returned = _Layout.learn(output, leaves, self.signature.state_slots)
        self.learn(layout)
        return tuple(returned)


class _state_as_inputs:
    """Every state object of the call holds the given tensors for the block (`tensors_replaced`)."""

    def __init__(self, signature: Signature, leaves: list, tensors: list[torch.Tensor]):
        self.replacements = []
        at = 0
        for slot in signature.state_slots:
            count = len(_state_tensors(leaves[slot]))
            self.replacements.append(tensors_replaced(leaves[slot], tensors[at : at + count]))
            at += count

    def __enter__(self) -> None:
        for replacement in self.replacements:
            replacement.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for replacement in reversed(self.replacements):
            replacement.__exit__(*exc)


class _Program:
    """One signature's compiled library, loaded, with where its inputs come from and its output goes."""

    def __init__(self, path: Path, tensor_slots: list[int], layout: _Layout, constants: dict[str, torch.Tensor]):
        self.path, self.tensor_slots, self.layout = path, tensor_slots, layout
        self.loader = _torch_compat.aoti_load(path)
        self.use(constants)

    def use(self, constants: dict[str, torch.Tensor]) -> None:
        """Hands the library the module's tensors it names; raises `NotExportable` if one is missing."""
        names = _torch_compat.aoti_constant_names(self.loader)
        missing = [name for name in names if name not in constants]
        if missing:
            raise NotExportable(
                f"it reads {len(missing)} tensors that are no parameter or buffer of the module ({missing[0]}...)"
            )
        _torch_compat.aoti_use_constants(self.loader, {name: constants[name] for name in names})


class AOTIRunner(Runner):
    """Runs each supported signature's library; signatures with state that an untrusted load must compile
    here are exported at their first call (`pending`)."""

    def __init__(self, backend: AOTIBackend, target: Target, spec: ModuleSpec, device: torch.device):
        super().__init__(set())
        self.backend, self.target, self.spec, self.device = backend, target, spec, device
        self.programs: dict[int, _Program] = {}
        self.refused: dict[int, str] = {}
        #: signatures compiled at their first call (an untrusted load: only a real call brings their state)
        self.pending: set[int] = set()
        self.folder = Path(tempfile.mkdtemp(prefix="xpupack-aoti-"))
        self._lock = threading.Lock()  # one library runner per program: calls from threads take turns
        self._watch = StorageWatch(target.module)

    def constants(self) -> dict[str, torch.Tensor]:
        module = self.target.module
        found = {_PREFIX + name: t for name, t in module.named_buffers(remove_duplicate=False)}
        found.update((_PREFIX + name, p.detach()) for name, p in module.named_parameters(remove_duplicate=False))
        return found

    def add(self, index: int, program: _Program) -> None:
        self.programs[index] = program
        self.supported.add(index)

    def run(self, index: int, args: tuple, kwargs: dict, leaves: list) -> Any:
        """Runs signature ``index``'s library on the call's tensors. See `Runner.run`."""
        program = self.programs.get(index)
        if program is None:  # `pending`: compiled here at its first call
            program = self._compile_now(index, args, kwargs)
        signature = self.spec.signatures[index]
        inputs = [leaves[slot].contiguous() for slot in program.tensor_slots]
        if signature.state_slots:
            inputs += signature.state_tensors(leaves)
        with self._lock:
            if self._watch.changed():  # `.to()`, `load_state_dict(assign=True)`: the library reads the new ones
                self._reload()
            outputs = _torch_compat.aoti_run(program.loader, inputs)
        return program.layout.rebuild(outputs, leaves)

    def _reload(self) -> None:
        constants = self.constants()
        for program in self.programs.values():
            program.use(constants)
        self._watch = StorageWatch(self.target.module)

    def _compile_now(self, index: int, args: tuple, kwargs: dict) -> _Program:
        with self._lock:
            if index not in self.programs:
                self.add(index, self.backend.compile_signature(self, index, args, kwargs))
            self.pending.discard(index)
            return self.programs[index]

    def unbuilt(self) -> dict[int, str]:
        return dict(self.refused)

    def release(self) -> None:
        """Nothing to free: the libraries hold no memory beyond their own small buffers."""

    def describe(self) -> dict:
        return {
            "programs": len(self.programs),
            **({"compiled_at_first_call": sorted(self.pending)} if self.pending else {}),
        }

    def __del__(self) -> None:
        shutil.rmtree(getattr(self, "folder", ""), ignore_errors=True)


@register_backend
class AOTIBackend(Backend):
    """Compiles each recorded signature ahead of time with AOTInductor (`torch.export` +
    ``aoti_compile_and_package``): a load maps the compiled libraries in and serves at once, with no
    compiler in the loading process (docs/cold-start.md).

    Takes signatures whose inputs are tensors, constants and StaticCache KV caches (no sliding-window
    layers), and whose outputs are tensors, constants and those caches; others run the original module.
    Calls that need autograd or autocast fall back, as for every compiled backend.

    Examples:
        >>> xpupack.AOTIBackend()
        >>> xpupack.GraphBackend(base=xpupack.AOTIBackend())  # compiled ahead of time, recorded as a device graph
    """

    name = "aoti"
    depends_on = AOTI_DEPENDS_ON
    compiled_artifacts = True
    compiles_at_load = False
    pads_calls = True
    #: Inductor's kernels: the same rounding
    low_precision_sqnr_db = LOW_PRECISION_SQNR_DB

    def available(self, device: torch.device) -> bool:
        """On a CPU only (`_facts.AOTI_NOT_ON_GPUS`: torch's loader crashed the process on CUDA).

        Args:
            device: the device tuned or loaded on.

        Returns:
            Whether ``device`` is a CPU.
        """
        return _facts.AOTI.available(device)

    def why_unavailable(self, device: torch.device) -> str:
        """See `available`.

        Args:
            device: the device tuned or loaded on.

        Returns:
            One sentence.
        """
        return _facts.AOTI.why_unavailable(device)

    def build(self, target: Target, spec: ModuleSpec, device: torch.device) -> Runner:
        """Exports and compiles every recorded signature. See `Backend.build`.

        Raises:
            RuntimeError: no signature could be compiled (the reasons, per signature).
        """
        runner = AOTIRunner(self, target, spec, device)
        for index in range(len(spec.signatures)):
            if spec.samples is not None and not spec.samples.count(index):
                continue
            try:
                with spec.samples.mode(index) if spec.samples is not None else torch.no_grad():
                    args, kwargs = spec.example(index)
                runner.add(index, self.compile_signature(runner, index, args, kwargs))
            except Exception as exc:  # export and compile fail in many ways; the signature runs the original
                runner.refused[index] = f"not compiled ahead of time: {error_line(exc)}"
        if not runner.supported:
            raise RuntimeError("no signature was compiled: " + "; ".join(sorted(set(runner.refused.values())))[:500])
        return runner

    def compile_signature(self, runner: AOTIRunner, index: int, args: tuple, kwargs: dict) -> _Program:
        """Exports signature ``index`` from one call of it (its values are not kept) and compiles it into
        ``runner.folder``; the state objects' contents stay as they were."""
        signature = runner.spec.signatures[index]
        leaves, _ = flatten(args, kwargs)
        if runner.spec.mutates_inputs or runner.spec.writes_buffers:
            raise NotExportable("the module writes its inputs or buffers")
        for slot in signature.state_slots:
            with tensors_replaced(leaves[slot], _state_tensors(leaves[slot])):
                pass  # raises `StateNotReady` for state xpupack cannot hand in as inputs
        wrapper = _Exported(
            runner.target,
            signature,
            [leaf.value if isinstance(leaf, ConstantLeaf) else None for leaf in signature.leaves],
        )
        for slot in signature.state_slots:
            wrapper.leaves[slot] = leaves[slot]
        # the example's tensors, and zeroed copies of its state: tracing never writes the caller's cache
        inputs = [leaves[slot].detach().clone().contiguous() for slot in wrapper.tensor_slots]
        if signature.state_slots:
            inputs += [_fresh_like(tensor) for tensor in signature.state_tensors(leaves)]
        with torch.no_grad(), _device.on_device(runner.device):
            exported = torch.export.export(wrapper, tuple(inputs), strict=False)
            path = _torch_compat.aoti_compile(exported, runner.folder / f"signature-{index}.pt2")
        layout = wrapper.learnt()
        if layout is None:
            raise NotExportable("its forward was never traced")
        program = _Program(path, wrapper.tensor_slots, layout, runner.constants())
        # a weight compiled into the code would never see the model change: each must be one handed in
        handed_in = set(_torch_compat.aoti_constant_names(program.loader))
        weights = {**exported.graph_signature.inputs_to_parameters, **exported.graph_signature.inputs_to_buffers}
        baked = {weights[node.name] for node in exported.graph.nodes if node.name in weights and node.users}
        if baked - handed_in:
            raise NotExportable(f"the library holds {sorted(baked - handed_in)[0]} in its code, not as a weight")
        return program

    def save(self, runner: Runner, folder: Path) -> dict:
        """Copies each library into ``folder`` (``signature-<i>.pt2``); the config says which signature each
        serves and how its output is rebuilt."""
        assert isinstance(runner, AOTIRunner)
        folder.mkdir(parents=True, exist_ok=True)
        programs = {}
        for index, program in sorted(runner.programs.items()):
            if index >= len(runner.spec.signatures):
                continue  # a size met while serving: not in the spec
            name = f"signature-{index}.pt2"
            shutil.copyfile(program.path, folder / name)
            programs[str(index)] = {"file": name, "outputs": program.layout.to_json()}
        return {"programs": programs}

    def restore(
        self, target: Target, spec: ModuleSpec, config: dict, folder: Path, device: torch.device, *, use_artifacts: bool
    ) -> Runner:
        """Maps the stored libraries in (``use_artifacts``), or compiles here: at once for signatures
        without state, at their first call for signatures with state. See `Backend.restore`.

        Raises:
            PackageFormatError: a config or library that is malformed.
            RuntimeError: no signature could be served.
        """
        runner = AOTIRunner(self, target, spec, device)
        programs = config.get("programs")
        if not isinstance(programs, dict):
            raise ValueError("the aoti config lists no programs")
        with _device.on_device(device):
            for key, entry in programs.items():
                index = _index(key, spec)
                signature = spec.signatures[index]
                if use_artifacts:
                    layout = _Layout.from_json(entry.get("outputs") if isinstance(entry, dict) else None, signature)
                    path = artifact_file(folder, entry.get("file"))
                    slots = [i for i, leaf in enumerate(signature.leaves) if isinstance(leaf, TensorLeaf)]
                    runner.add(index, _Program(path, slots, layout, runner.constants()))
                elif signature.state_slots:
                    runner.pending.add(index)
                    runner.supported.add(index)
                else:
                    try:
                        args, kwargs = signature.synthesize()
                        runner.add(index, self.compile_signature(runner, index, args, kwargs))
                    except (NotExportable, StateNotReady) as exc:
                        runner.refused[index] = f"not compiled ahead of time: {exc}"
        if not runner.supported:
            raise RuntimeError("no signature of the package could be served")
        return runner


def _state_tensors(obj: Any) -> list[torch.Tensor]:
    kind = state_type(obj)
    assert kind is not None  # a state leaf holds a state object
    return kind.state_tensors(obj)


def _index(key: Any, spec: ModuleSpec) -> int:
    if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < len(spec.signatures)):
        raise ValueError(f"the aoti config names signature {key!r}, which the spec does not hold")
    return int(key)


def _fresh_like(tensor: torch.Tensor) -> torch.Tensor:
    """A zeroed tensor of ``tensor``'s layout, outside inference mode (export traces normal tensors)."""
    with torch.inference_mode(False):
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device).zero_()
