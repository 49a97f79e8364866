"""How a call of a repeated layer is described for :mod:`torchroof.capture.replay`: every
tensor it can read and how each is reached (its arguments, parameters and buffers, its
entry of a transformers ``Cache``), what makes two calls alike, and the state a call leaves
in its cache entry."""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from torchroof.capture.storage import held_tensors
from torchroof.capture.symbolic import keyed

INDEX_ATTRIBUTES = frozenset(
    {"layer_idx", "layer_id", "layer_index", "layer_number", "layer_num", "block_idx", "idx"}
)
_PLAIN = (bool, int, float, str, type(None))

Route = tuple[Any, ...]  # how a tensor is reached from a layer call: ("arg", 3), ("param", "w", 0)


def structure_key(layer: torch.nn.Module) -> tuple[Any, ...]:
    """The layer's class and, for every submodule, its class, its plain attributes by value
    (head counts, sliding window, layer type; not its index), any other attribute by
    identity (a forward patched on one instance, a per-layer object: a kind of its own;
    the config every layer shares: alike), and whether it carries hooks of its own (a
    replay would skip them). The layer's own FSDP2 state is left out: its hooks run around
    a copy as around the layer."""
    parts: list[Any] = [type(layer).__name__]
    for name, module in layer.named_modules():
        attributes = tuple(
            (attr, _attribute_key(value, module))
            for attr, value in sorted(vars(module).items())
            if attr not in INDEX_ATTRIBUTES
            and attr not in _MODULE_INTERNALS
            and not (module is layer and attr.startswith(COMPOSABLE_STATE))
        )
        hooked = bool(name) and bool(
            module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
        )
        parts.append((name, type(module).__name__, attributes, hooked))
    return tuple(parts)


# where torch.distributed's composable APIs (fully_shard) keep a module's state
# (torch/distributed/_composable/contract.py: a key of this prefix and a uuid)
COMPOSABLE_STATE = "__composable_api_state_key"
# what every nn.Module holds (parameters, buffers, submodules, hooks): keyed elsewhere
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def _attribute_key(value: Any, owner: torch.nn.Module | None = None, depth: int = 0) -> Any:
    """An attribute as a key: plain values by value; functions, partials and bound methods by
    their code and what they close over (a tensor-parallel plan's per-layer forward closure,
    torchao's per-layer extra_repr: alike where they wrap the same code around alike parts);
    the owning module as ``self``; any other object by identity."""
    if value is owner:
        return "self"
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return tuple(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if depth < 4:
        deeper = functools.partial(_attribute_key, owner=owner, depth=depth + 1)
        if isinstance(value, types.MethodType):
            return ("method", deeper(value.__func__), deeper(value.__self__))
        if isinstance(value, functools.partial):
            keywords = tuple((k, deeper(v)) for k, v in sorted(value.keywords.items()))
            return ("partial", deeper(value.func), tuple(map(deeper, value.args)), keywords)
        if isinstance(value, types.FunctionType):
            cells = tuple(deeper(_cell_contents(c)) for c in value.__closure__ or ())
            return ("function", id(value.__code__), cells, deeper(value.__defaults__))
    return (type(value).__name__, id(value))


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return None


def reachable(
    layer: torch.nn.Module, position: int, leaves: list[Any]
) -> dict[Route, torch.Tensor]:
    """Every plain tensor a call of ``layer`` (at ``position`` in its list) can read, by how
    it is reached: its arguments, its parameters and buffers (a sharded or quantised one by
    each tensor it holds) and, for a transformers ``Cache`` argument, the cache's entry for
    this layer."""
    found: dict[Route, torch.Tensor] = {}
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            for j, held in enumerate(held_tensors(leaf)):
                found[("arg", index, j)] = held
        else:
            for where, cache in caches_in(leaf):
                entry = cache_entry(cache, position)
                for attr, value in vars(entry).items() if entry is not None else ():
                    for j, held in enumerate(tensors_of(value)):
                        found[("cache", index, where, attr, j)] = held
    for name, param in layer.named_parameters():
        for j, held in enumerate(held_tensors(param)):
            found[("param", name, j)] = held
    for name, buffer in layer.named_buffers():
        for j, held in enumerate(held_tensors(buffer)):
            found[("buffer", name, j)] = held
    return found


def call_key(
    shape: tuple[Any, ...],
    reach: dict[Route, torch.Tensor],
    leaves: list[Any],
    spec: Any,
    suppressed: bool,
    phase: str,
) -> tuple[Any, ...]:
    """Calls with equal keys run the same ops on storages in the same places: the tensors
    they read alike, and aliased alike (each route keyed by the first route reaching the
    same storage: ``layer(x, residual=x)`` is not ``layer(x, residual=y)``)."""
    first_route: dict[int, int] = {}
    tensors = tuple(
        (path, describe(t), first_route.setdefault(t.untyped_storage()._cdata, n))
        for n, (path, t) in enumerate(reach.items())
    )
    others = tuple(_leaf_key(leaf) for leaf in leaves if not isinstance(leaf, torch.Tensor))
    return (shape, tensors, others, str(spec), suppressed, phase)


def describe(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (
        type(tensor).__name__,
        tuple(keyed(s) for s in tensor.shape),
        tuple(keyed(s) for s in tensor.stride()),
        tensor.dtype,
        keyed(tensor.storage_offset()),
        tensor.requires_grad,
        tensor.device.type,
    )


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, _PLAIN):
        return leaf
    if isinstance(leaf, torch.SymInt):  # a size in a capture with symbolic sizes
        return keyed(leaf)
    if isinstance(leaf, (torch.dtype, torch.device)):
        return str(leaf)
    return (type(leaf).__name__, id(leaf))  # an object: alike only when it is the same one


def is_cache(leaf: Any) -> bool:
    """A transformers Cache (its per-layer entries in ``layers``)."""
    layers = getattr(leaf, "layers", None)
    return isinstance(layers, list) and type(leaf).__module__.split(".")[0] == "transformers"


def caches_in(leaf: Any) -> list[tuple[str, Any]]:
    """The transformers Caches an argument is or holds (an encoder-decoder's self- and
    cross-attention caches), each with the attribute it is held in ("" for itself)."""
    if isinstance(leaf, (torch.Tensor, torch.nn.Module, *_PLAIN)) or not hasattr(leaf, "__dict__"):
        return []
    if is_cache(leaf):
        return [("", leaf)]
    if type(leaf).__module__.split(".")[0] != "transformers":
        return []
    return [(attr, value) for attr, value in vars(leaf).items() if is_cache(value)]


def cache_entry(leaf: Any, position: int) -> Any:
    """A transformers Cache's entry for the layer at ``position`` (None for anything else)."""
    if not is_cache(leaf):
        return None
    layers = leaf.layers
    return layers[position] if position < len(layers) else None


def tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return held_tensors(value)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def cache_entries(leaves: list[Any], position: int) -> list[Any]:
    return [
        entry
        for leaf in leaves
        for _, cache in caches_in(leaf)
        if (entry := cache_entry(cache, position)) is not None
    ]


def entry_snapshot(entry: Any) -> dict[tuple[str, Any], Any]:
    """A cache entry's attributes, and the items of the lists and dicts it holds (a linear
    attention entry updates ``conv_states[0]`` in place)."""
    found: dict[tuple[str, Any], Any] = {}
    for attr, value in vars(entry).items():
        found[(attr, None)] = value
        if isinstance(value, list):
            found.update({(attr, i): item for i, item in enumerate(value)})
        elif isinstance(value, dict):
            found.update({(attr, key): item for key, item in value.items()})
    return found


def entry_changes(
    before: dict[tuple[str, Any], Any], after: dict[tuple[str, Any], Any]
) -> dict[tuple[str, Any], Any]:
    """What a call set: attributes rebound, and items of containers kept but changed."""
    rebound = {
        a for (a, item), v in after.items() if item is None and before.get((a, None)) is not v
    }
    return {
        (a, item): v
        for (a, item), v in after.items()
        if (item is None and a in rebound)
        or (
            item is not None
            and a not in rebound
            and ((a, item) not in before or before[(a, item)] is not v)
        )
    }


def entry_key(entry: Any) -> tuple[Any, ...]:
    """The plain state of a cache entry (its tensors are keyed by :func:`reachable`)."""
    return tuple(
        (slot, value if isinstance(value, _PLAIN) else type(value).__name__)
        for slot, value in entry_snapshot(entry).items()
        if not isinstance(value, torch.Tensor)
    )


def module_state(layer: torch.nn.Module) -> list[dict[str, Any]]:
    """Every submodule's attributes by identity, its parameters and buffers by identity, and
    the contents of the lists and dicts it holds (a replay sets none of them): a buffer
    rebound or a list appended to is state a copy would not leave."""
    found = []
    for m in layer.modules():
        state: dict[str, Any] = {k: id(v) for k, v in vars(m).items()}
        state["(tensors)"] = [(n, id(t)) for n, t in (*m._parameters.items(), *m._buffers.items())]
        for k, v in vars(m).items():
            if isinstance(v, (list, dict)) and not k.startswith("_"):
                state[f"({k})"] = [id(x) for x in (v.values() if isinstance(v, dict) else v)]
        found.append(state)
    return found


def hooked(layer: torch.nn.Module) -> bool:
    """Whether a submodule of ``layer`` (not the layer itself: its own hooks run around the
    copy) carries hooks, which a copy would not run."""
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        for m in layer.modules()
        if m is not layer
    )
