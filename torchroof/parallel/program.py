"""Parallel programs on one CPU: torch.distributed's own parallelism on a fake process group.

DESIGN.md "Parallel programs on one CPU": no home-made model of tensor parallelism or FSDP.
The model gets PyTorch's (and transformers') real parallel plans on a process group of N
fake ranks, and capture records the program one rank runs: its local ops at per-rank
shapes and its collectives with their groups (torchroof.capture.mode, torchroof.counters
.collectives). Steps in torchtitan's order (``models/llama3/parallelize.py``), one small
function each::

    plan = ParallelPlan(fsdp=4, tp=2)
    with fake_process_group(plan.world):
        mesh = build_mesh(plan)
        model = ...                                  # built on meta
        apply_tensor_parallel(model, mesh["tp"])
        apply_fsdp(model, mesh)
        with fake_parameters(model):                 # FSDP2 refuses meta parameters
            ids = torch.zeros(batch, seq, dtype=torch.long)
            with torchroof.trace() as trace:
                model(ids, labels=ids).loss.backward()

Context parallel (no FSDP yet) wraps the step instead:
``with apply_context_parallel(model, mesh["cp"]):`` each forward then runs on the rank's
T/cp tokens with torch's ring attention.

Rank 0 is the rank traced (ranks are symmetric under these plans).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "fsdp", "cp", "tp")
"""Mesh dimensions, outermost first, as torchtitan orders them: tensor parallel innermost,
so a TP group is consecutive ranks (one node's NVLink domain); pipeline stages outermost,
so stage s runs on ranks s · (world / pp) + ... ."""

FAKE_BACKEND = "fake"
# The attribute apply_tensor_parallel sets on a model: the KV heads one rank holds (a KV
# cache built for the model's rank is this many heads wide).
KV_HEADS_PER_RANK = "torchroof_kv_heads_per_rank"
KEEP_FULL_WEIGHT = "keep_full_weight"  # transformers' FSDP style: no reshard after forward
FREE_FULL_WEIGHT = "free_full_weight"  # transformers' FSDP style: reshard after forward


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` fake ranks, this process rank 0; its
    collectives return at once (``torch.testing._internal.distributed.fake_pg``). Destroyed
    on exit. Re-entrant: inside a fake group of the same size it is a no-op (the outer one
    destroys it); any other initialised group is an error."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if dist.is_initialized():
        backend, size = dist.get_backend(), dist.get_world_size()
        if backend == FAKE_BACKEND and size == world_size:
            yield
            return
        raise RuntimeError(
            f"a process group is already initialised (backend {backend!r}, {size} ranks); "
            f"a fake group of {world_size} ranks cannot replace it: leave the outer one first"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class ParallelPlan:
    """How many ranks each kind of parallelism spans; the world is their product.

    ``pp``: pipeline stages (one traced program per distinct stage,
    torchroof.parallel.pipeline.price).
    ``dp``: replicas (HSDP's replicate dimension when ``fsdp`` > 1). ``fsdp``: ranks each
    parameter is sharded over (FSDP2, ZeRO-3). ``cp``: context parallel (sequence shards).
    ``tp``: tensor parallel (the model's ``base_model_tp_plan``). ``ep``: expert parallel,
    not a dimension of its own: the routed experts are sharded over groups of ``ep``
    consecutive ranks of one stage (torchroof.parallel.expert), which hold different
    batches (dp, fsdp) or the same one (tp) for everything else.
    """

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in (*MESH_DIMS, "ep"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelPlan.{name} must be a positive integer, got {size!r}")

    @property
    def world(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes in :data:`MESH_DIMS` order."""
        return tuple(getattr(self, name) for name in MESH_DIMS)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return MESH_DIMS


def build_mesh(plan: ParallelPlan) -> DeviceMesh:
    """The device mesh of ``plan`` on CPU, every dimension named (size-1 ones too, so
    ``mesh["tp"]`` always exists). Needs a process group of ``plan.world`` ranks."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"build_mesh needs a process group of {plan.world} ranks: "
            f"call it inside `with fake_process_group({plan.world}):`"
        )
    if dist.get_world_size() != plan.world:
        raise ValueError(
            f"{plan} spans {plan.world} ranks, but the process group has {dist.get_world_size()}"
        )
    with _rank_zero_groups():
        return init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=MESH_DIMS)


class _NotThisRank:
    """A sub-group this rank is not in: the mesh reads only its (unused) name."""

    group_name = None


@contextlib.contextmanager
def _rank_zero_groups() -> Iterator[None]:
    """Create only the mesh's sub-groups that hold this rank (rank 0 is the one traced).
    ``init_device_mesh`` makes every group of every dimension (world / size of each), which
    a real job needs on every rank but a fake one does not: with it the cost of a step grew
    with the world size (140,000 groups, 12 s, for tp=2 x dp=20,000) though rank 0's trace
    is the same; without, it is a handful of groups whatever the world."""
    import torch.distributed.device_mesh as device_mesh

    real = device_mesh.new_group
    rank = dist.get_rank()

    def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        if ranks is not None and rank not in ranks:
            return _NotThisRank()
        return real(ranks, *args, **kwargs)

    device_mesh.new_group = new_group  # type: ignore[assignment]
    try:
        yield
    finally:
        device_mesh.new_group = real  # type: ignore[assignment]


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str] | None = None
) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` with its transformers tensor-parallel plan (or
    ``plan``: module or parameter name, ``*`` for layer numbers, -> transformers style
    name such as ``"colwise"``, ``"rowwise"``, ``"embedding_rowwise"``), through
    transformers' own ``apply_tensor_parallelism``: parameters become DTensor shards and
    each planned module converts its input and output (a row-wise layer's partial sums are
    all-reduced). A TP group of one leaves the model as it is. Works on meta. The KV
    heads each rank then holds are set on the model as :data:`KV_HEADS_PER_RANK`."""
    size = tp_mesh.size()
    if size == 1:
        return model
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    wildcard_plan = _transformers_plan(model, "tp_plan", plan)
    config = getattr(model, "config", None)
    kv_heads = _check_heads_divide(config, wildcard_plan, size) if config is not None else None
    expanded = owned_plan(model, model._expand_parallel_plan(wildcard_plan))  # type: ignore[operator]
    apply_tensor_parallelism(model, tp_mesh, expanded)
    if isinstance(kv_heads, int):
        setattr(model, KV_HEADS_PER_RANK, kv_heads)
    return model


# Module names of the Llama layout torchtitan's sequence-parallel plan is written for (as
# transformers names them): the model's embedding, final norm and head, and per decoder layer
# exactly these children, the attention's four projections and the MLP's three.
LLAMA_LAYER_CHILDREN = frozenset(
    {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
)
LLAMA_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def apply_sequence_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool = True
) -> nn.Module:
    """Shard a Llama-layout ``model`` over ``tp_mesh`` with torchtitan's tensor + sequence
    parallel plan (``models/llama3/infra/parallelize.py`` ``apply_tp``), through
    ``parallelize_module``: between layers the residual stream is split along the sequence
    (``Shard(1)``): the embedding's partial sums are reduce-scattered onto it, the norms run
    on each rank's T/tp tokens (``SequenceParallel``), the attention and the MLP all-gather
    their input (``PrepareModuleInput`` Shard(1) -> Replicate) and their row-wise output
    projections reduce-scatter back (``RowwiseParallel(output_layouts=Shard(1))``): each
    all-reduce of plain tensor parallel becomes a reduce-scatter plus an all-gather. The LM
    head all-gathers the final norm's tokens; with ``loss_parallel`` its logits stay split
    over the vocabulary (``Shard(-1)``, a DTensor) for a cross-entropy run under
    ``torch.distributed.tensor.parallel.loss_parallel()``, else they are gathered whole
    (generation samples from the whole vocabulary). The residual stream stays a DTensor of
    global shape (torchtitan's uses local tensors), so transformers' mask and positions see
    all T tokens. Attention reshapes with ``-1`` heads, so it runs on the rank's local heads
    as it does under transformers' plan; the KV heads per rank are set as
    :data:`KV_HEADS_PER_RANK`. A TP group of one leaves the model as it is. Works on meta.

    Refuses (ValueError) a model whose modules do not follow the Llama layout
    (:func:`check_llama_layout`) or whose heads do not divide by the group."""
    size = tp_mesh.size()
    if size == 1:
        return model
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    layers = check_llama_layout(model)
    config = getattr(model, "config", None)
    kv_heads = None
    if config is not None:
        kv_heads = _check_heads_divide(config, {"layers.*.self_attn.k_proj": "colwise"}, size)
    embedding, head = model.get_submodule("model.embed_tokens"), model.get_submodule("lm_head")
    tied = not not_owned(head) and head.weight is getattr(embedding, "weight", None)
    logits = (Shard(-1), False) if loss_parallel else (Replicate(), True)
    sequence = Shard(1)  # (B, T, d): the residual stream split along T between layers
    ends = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=sequence, use_local_output=False
        ),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=sequence, output_layouts=logits[0], use_local_output=logits[1]
        ),
    }
    # a pipeline stage shards only the ends it owns (issue 14)
    owned = {n: style for n, style in ends.items() if not not_owned(model.get_submodule(n))}
    if owned:
        parallelize_module(model, tp_mesh, owned)
    if tied:  # both vocabulary-sharded (Shard(0) of the same V x d table): one parameter
        head.weight = embedding.weight
    gathered = {"hidden_states": Replicate()}
    for layer in layers:
        parallelize_module(
            layer,
            tp_mesh,
            {
                "input_layernorm": SequenceParallel(),
                # the decoder layer passes hidden_states by keyword
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": sequence},
                    desired_input_kwarg_layouts=gathered,
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(
                    output_layouts=sequence, use_local_output=False
                ),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(
                    input_layouts=(sequence,), desired_input_layouts=(Replicate(),)
                ),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=sequence, use_local_output=False),
            },
        )
    if isinstance(kv_heads, int):
        setattr(model, KV_HEADS_PER_RANK, kv_heads)
    return model


def check_llama_layout(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a model laid out as transformers' Llama (``model.embed_tokens``
    an embedding, ``model.layers.*`` with exactly ``input_layernorm``, ``self_attn`` (linear
    ``q/k/v/o_proj``), ``post_attention_layernorm`` and ``mlp`` (linear ``gate/up/down_proj``),
    ``model.norm``, a linear ``lm_head``), checked by module name, not model type; a
    ValueError naming the first module that differs. A pipeline stage's modules it does not
    own (transformers' ``PipelineIdentityLayer``) are skipped: its own layers are returned."""
    name = type(model).__name__

    def module(path: str, kind: type[nn.Module] | None = None) -> nn.Module:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            found = None
        if found is None or (kind is not None and not isinstance(found, kind)):
            what = f"an nn.{kind.__name__} " if kind is not None else ""
            raise ValueError(
                f"sequence parallel follows torchtitan's Llama plan, which needs {what}"
                f"{path!r}; {name} has no such module (only models laid out as transformers' "
                "Llama take it: use tensor parallel without sequence parallel)"
            )
        return found

    for path, kind in (("model.embed_tokens", nn.Embedding), ("lm_head", nn.Linear)):
        try:
            found = model.get_submodule(path)
        except AttributeError:
            found = None
        if not not_owned(found):  # a pipeline stage checks only the ends it owns
            module(path, kind)
    module("model.norm")
    every = list(module("model.layers").children())
    if not every:
        raise ValueError(f"{name}.model.layers holds no decoder layer")
    layers = []
    for index, layer in enumerate(every):
        if not_owned(layer):  # another pipeline stage's
            continue
        layers.append(layer)
        children = {child for child, _ in layer.named_children()}
        if children != LLAMA_LAYER_CHILDREN:
            raise ValueError(
                f"sequence parallel follows torchtitan's Llama plan: {name}.model.layers."
                f"{index} holds {', '.join(sorted(children))}, not exactly "
                f"{', '.join(sorted(LLAMA_LAYER_CHILDREN))} (use tensor parallel without "
                "sequence parallel)"
            )
        for projection in LLAMA_ATTENTION_PROJECTIONS:
            module(f"model.layers.{index}.self_attn.{projection}", nn.Linear)
        for projection in LLAMA_MLP_PROJECTIONS:
            module(f"model.layers.{index}.mlp.{projection}", nn.Linear)
    return layers


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    plan: dict[str, str] | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters with FSDP2 ``fully_shard`` over the mesh's ``fsdp``
    dimension (HSDP over ``("dp", "fsdp")`` when ``dp`` > 1), as transformers' FSDP plan
    (``base_model_fsdp_plan``, or ``plan``) groups them: each planned module (a decoder
    layer, the embeddings) is one all-gather / reduce-scatter unit, the final norm and the
    LM head one unit kept unsharded after forward, then the root. ``reshard_after_forward``
    False keeps every unit gathered until backward (ZeRO-2-like: no all-gather in
    backward). A mesh whose ``dp`` and ``fsdp`` are both 1 leaves the model as it is.
    ``ignored_params`` stay out of every unit (experts each held by one rank).

    NB: FSDP2 refuses meta parameters at its first forward; run the step inside
    :func:`fake_parameters`."""
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed.fsdp import (
        _resolve_tied_embed_lm_head_plan,
        is_norm_and_head_pair,
    )

    names = mesh.mesh_dim_names or ()
    if "fsdp" not in names or "dp" not in names:
        raise ValueError(f"apply_fsdp needs a mesh from build_mesh (dims {MESH_DIMS}), got {names}")
    replicas, shards = mesh["dp"].size(), mesh["fsdp"].size()
    if replicas * shards == 1:
        return model
    if "cp" in names and mesh["cp"].size() > 1:
        raise ValueError("apply_fsdp does not yet shard over the context-parallel dimension")
    shard_mesh = mesh["dp", "fsdp"] if replicas > 1 else mesh["fsdp"]

    wildcard_plan = _transformers_plan(model, "fsdp_plan", plan)
    expanded = owned_plan(model, model._expand_parallel_plan(wildcard_plan))  # type: ignore[operator]
    expanded = _resolve_tied_embed_lm_head_plan(expanded, model) if expanded else _blocks(model)
    # FSDP2 needs a submodule sharded before the module that holds it.
    units = sorted(expanded.items(), key=lambda item: item[0].count("."), reverse=True)
    ignored = ignored_params or set()
    kept = [(name, model.get_submodule(name)) for name, style in units if style == KEEP_FULL_WEIGHT]

    def shard(modules: nn.Module | list[nn.Module], reshard: bool) -> None:
        odd = _odd_dtype_params(modules, ignored)
        if odd:
            left_out.update(odd)
        skip = ignored | odd
        extra: dict[str, Any] = {"ignored_params": skip} if skip else {}
        fully_shard(modules, mesh=shard_mesh, reshard_after_forward=reshard, **extra)

    left_out: set[nn.Parameter] = set()

    for name, style in units:
        if style != KEEP_FULL_WEIGHT:
            shard(model.get_submodule(name), reshard_after_forward)
    if is_norm_and_head_pair(kept, model):
        shard([module for _, module in kept], False)
    else:
        for _, module in kept:
            shard(module, False)
    shard(model, reshard_after_forward)
    if left_out:
        note = (
            f"FSDP: {len(left_out)} parameters of another dtype than their unit's "
            f"({', '.join(sorted({str(p.dtype) for p in left_out}))}, e.g. router weights) "
            "left unsharded, their gradients not reduced: FSDP2 shards one dtype per unit"
        )
        previous = getattr(model, "torchroof_build_note", "")
        model.torchroof_build_note = f"{previous}; {note}" if previous else note
    return model


def _odd_dtype_params(
    modules: nn.Module | list[nn.Module], ignored: set[nn.Parameter]
) -> set[nn.Parameter]:
    """Parameters a unit would hold beside others of another dtype: FSDP2 all-gathers a
    unit as one flat buffer and refuses mixed original dtypes. The ones outside the unit's
    dominant dtype (by elements; DeepSeek-V3 keeps its router weights in fp32) are left out
    of it, unsharded."""
    from torch.distributed.fsdp import FSDPModule

    roots = modules if isinstance(modules, list) else [modules]
    managed: set[nn.Parameter] = set()
    for root in roots:
        inner = {
            p
            for m in root.modules()
            if m is not root and isinstance(m, FSDPModule)
            for p in m.parameters()
        }
        managed |= {p for p in root.parameters() if p not in inner and p not in ignored}
    sizes: dict[torch.dtype, int] = {}
    for p in managed:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return set()
    dominant = max(sizes, key=sizes.__getitem__)
    return {p for p in managed if p.dtype != dominant}


def not_owned(module: nn.Module | None) -> bool:
    """A module a pipeline stage does not own: transformers' ``PipelineIdentityLayer``."""
    return type(module).__name__ == "PipelineIdentityLayer"


def owned_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` without the entries for modules a pipeline stage does not own (replaced by
    transformers' ``PipelineIdentityLayer``, or absent)."""
    kept = {}
    for name, style in plan.items():
        path = name
        while path:
            try:
                module = model.get_submodule(path)
            except AttributeError:
                path = path.rpartition(".")[0]  # a parameter's name: its module
                continue
            if not not_owned(module):
                kept[name] = style
            break
    return kept


def _blocks(model: nn.Module) -> dict[str, str]:
    """FSDP units as torchtitan makes them, for a model whose transformers FSDP plan names
    none of its modules (GPT-2's ``transformer.h``, not ``layers``): each block of its
    longest module list, and its input embeddings unless tied to the LM head; the rest goes
    with the root."""
    lists = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 1
    ]
    if not lists:
        raise ValueError(
            f"{type(model).__name__}: its FSDP plan names none of its modules and it has no "
            "list of blocks to shard one by one: pass plan= (module name -> FSDP style)"
        )
    name, blocks = max(lists, key=lambda item: len(item[1]))
    units = {f"{name}.{i}": FREE_FULL_WEIGHT for i in range(len(blocks))}
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and embeddings is not None and output.weight is embeddings.weight:
        embeddings = None  # tied to the LM head: one parameter, sharded with the root
    for path, module in model.named_modules():
        if embeddings is not None and module is embeddings:
            units[path] = FREE_FULL_WEIGHT
    return units


@contextlib.contextmanager
def fake_parameters(model: nn.Module, device: str = "cpu") -> Iterator[Any]:
    """Give every parameter and buffer of ``model`` a fake tensor of its shape on ``device``
    (``to_empty`` under a ``FakeTensorMode``: no memory, no values) and keep the mode on:
    tensors made inside (the batch) are fake too. FSDP2 runs on these where it refuses
    meta. Yields the mode. NB: the model holds fake tensors from then on; use it only inside
    such a block."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model.to_empty(device=device)
        yield mode


def _transformers_plan(
    model: nn.Module, attribute: str, given: dict[str, str] | None
) -> dict[str, str]:
    """``given``, else the model's own transformers plan (``tp_plan``, ``fsdp_plan``); a
    clear error for a model transformers did not build (its plans name its modules)."""
    if not hasattr(model, "_expand_parallel_plan"):
        raise ValueError(
            f"{type(model).__name__} is not a transformers PreTrainedModel: torchroof applies "
            "parallel plans through transformers (its configs ship them)"
        )
    plan = given if given is not None else getattr(model, attribute, None)
    if not isinstance(plan, dict) or not plan:
        kind = attribute.removesuffix("_plan")
        raise ValueError(
            f"{type(model).__name__} has no {attribute} (its config's base_model_{attribute} "
            f"is empty): pass plan= (module name -> transformers {kind} style)"
        )
    return dict(plan)


def check_tensor_parallel(config: Any, tp: int) -> None:
    """Refuse, before any model is built, a ``tp`` that ``config``'s tensor-parallel plan
    cannot run: no plan, or head counts that do not divide (a ValueError naming it)."""
    if tp == 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        raise ValueError(
            f"{type(config).__name__} has no base_model_tp_plan: transformers ships no tensor-"
            "parallel plan for this architecture"
        )
    _check_heads_divide(config, plan, tp)


def _check_heads_divide(config: Any, plan: dict[str, str], tp: int) -> Any:
    """Column-wise q/k/v projections split whole heads: the head counts must divide by tp
    (transformers' ``get_kv_heads_per_rank`` says None when the KV heads do not). Returns
    the KV heads per rank (None when the config does not say)."""
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and heads % tp:
        raise ValueError(f"num_attention_heads={heads} does not divide by tp={tp}")
    per_rank = get_kv_heads_per_rank(plan, kv, tp) if isinstance(kv, int) else None
    if isinstance(kv, int) and per_rank is None:
        raise ValueError(
            f"num_key_value_heads={kv} does not divide by tp={tp}: the column-wise k/v "
            "projections would split a head"
        )
    return per_rank


# -- context parallel ---------------------------------------------------------------------
CONTEXT_PARALLEL_ATTENTION = "torchroof_context_parallel"
"""The transformers attention implementation :func:`apply_context_parallel` registers."""
# Forward arguments of a transformers causal LM that run along the sequence (dim 1).
SEQUENCE_ARGUMENTS = ("input_ids", "position_ids", "labels", "inputs_embeds")


class ContextParallelError(ValueError):
    """A step that context parallel cannot run (raised while the step runs)."""


@contextlib.contextmanager
def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> Iterator[nn.Module]:
    """For the block, run ``model`` as one rank of context parallel over ``cp_mesh``, with
    torch's own ring attention (``torch.distributed.tensor.experimental``'s
    ``_context_parallel``), as torchtitan does for long sequences:

    - each forward's sequence arguments (:data:`SEQUENCE_ARGUMENTS`; position ids made for
      the whole sequence when not given) are sharded along the sequence by torch's
      ``_context_parallel_shard`` with its head-tail load balancer (rank r holds chunks r
      and 2·cp - 1 - r of 2·cp), so every layer runs on T/cp tokens;
    - attention (a transformers attention function registered as
      :data:`CONTEXT_PARALLEL_ATTENTION`) calls ``aten._scaled_dot_product_flash_attention``
      on the rank's q, k, v as sequence-sharded DTensors, which torch's context-parallel
      dispatcher runs as ring attention: the local causal block, then for each other rank's
      K/V a non-causal block (half the queries or half the keys, load-balanced), merged by
      log-sum-exp. K and V travel as torch's default rotater sends them: one
      ``all_gather_into_tensor`` of the rank's concatenated K and V per layer forward; the
      backward gathers them again and passes dK, dV round the ring with ``cp``
      ``all_to_all_single`` permutations (fp32). Capture records these as collectives on
      the cp group.

    transformers builds no mask for a registered attention function: the ring is causal
    by construction. Refused (:class:`ContextParallelError`): a sequence that does not
    split into 2·cp equal chunks, an attention mask, sliding windows, soft-capping, a
    non-causal model. The model is restored on exit. A group of one leaves it alone."""
    size = cp_mesh.size()
    if size == 1:
        yield model
        return
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from transformers import AttentionInterface

    if not hasattr(model, "set_attn_implementation"):
        raise ContextParallelError(
            f"{type(model).__name__} is not a transformers PreTrainedModel: context parallel "
            "replaces its attention through transformers' AttentionInterface"
        )

    def ring_attention(
        module: nn.Module,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Any, None]:
        check_ring_attention(module, attention_mask, kwargs, tokens=size * query.shape[2])
        if key.shape[2] != query.shape[2]:
            raise ContextParallelError(
                f"ring attention attends the rank's {query.shape[2]} queries to its own as "
                f"many keys; {key.shape[2]} came (a cache holding other tokens)"
            )
        return _ring_attention(cp_mesh, query, key, value, scaling, dropout), None

    def shard_sequence(_module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return _shard_sequence(cp_mesh, model, args, kwargs)

    AttentionInterface.register(CONTEXT_PARALLEL_ATTENTION, ring_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CONTEXT_PARALLEL_ATTENTION)
    hook = model.register_forward_pre_hook(shard_sequence, with_kwargs=True)
    # torch keeps these as module globals; _context_parallel_shard sets both
    saved = (ring._cp_options.enable_load_balance, ring._dispatch_mode)
    ring._enable_context_parallel_dispatcher()
    try:
        yield model
    finally:
        ring._disable_context_parallel_dispatcher()
        ring._cp_options.enable_load_balance, ring._dispatch_mode = saved
        hook.remove()
        model.set_attn_implementation(previous)


def check_ring_attention(
    module: nn.Module, attention_mask: Any, kwargs: dict[str, Any], tokens: int
) -> None:
    """Refuse what torch's load-balanced ring attention does not compute: a mask (padding,
    packed documents), a sliding window shorter than the sequence's ``tokens``, logit
    soft-capping, a non-causal layer."""
    name = type(module).__name__
    if attention_mask is not None:
        raise ContextParallelError(
            f"{name}: context parallel's ring attention is causal over whole sequences; it "
            "takes no attention mask (padding or packed documents)"
        )
    window = kwargs.get("sliding_window")
    if window is not None and window < tokens:
        raise ContextParallelError(
            f"{name} attends within a sliding window of {window} tokens, shorter than the "
            f"{tokens}-token sequence: torch's ring attention has no window"
        )
    if kwargs.get("softcap") is not None:
        raise ContextParallelError(
            f"{name} soft-caps its logits (softcap={kwargs['softcap']}): torch's ring "
            "attention does not"
        )
    if getattr(module, "is_causal", True) is False:
        raise ContextParallelError(
            f"{name} is not causal: torch's load-balanced ring attention is causal only"
        )


def _ring_attention(
    cp_mesh: DeviceMesh, query: Any, key: Any, value: Any, scale: float | None, dropout: float
) -> Any:
    """Flash attention on the rank's (B, H, T/cp, d) q and (B, H_kv, T/cp, d) k, v as
    DTensors sharded along the sequence: torch's context-parallel dispatcher runs the ring.
    Returns the rank's output as (B, T/cp, H, d), as transformers' attention functions do."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = [
        DTensor.from_local(t, cp_mesh, [Shard(2)], run_check=False) for t in (query, key, value)
    ]
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    out = flash(*sharded, dropout, True, False, scale=scale)[0]
    return out.to_local().transpose(1, 2)


def _shard_sequence(
    cp_mesh: DeviceMesh, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward's arguments with each of :data:`SEQUENCE_ARGUMENTS` replaced by this
    rank's load-balanced shard (torch's ``_context_parallel_shard`` with its head-tail
    balancer); position ids for the whole sequence are made first when not given (as
    torchtitan shards its RoPE table with the batch)."""
    from torch.distributed.tensor.experimental._context_parallel import (
        _context_parallel_shard,
        _HeadTailLoadBalancer,
    )

    values = dict(kwargs)
    if args:  # input_ids given by position
        values["input_ids"], args = args[0], args[1:]
    if values.get("attention_mask") is not None:
        raise ContextParallelError(
            "context parallel's ring attention takes no attention mask (padding or packed "
            "documents): pass none"
        )
    reference = values.get("input_ids")
    if reference is None:
        reference = values.get("inputs_embeds")
    if not isinstance(reference, torch.Tensor) or reference.dim() < 2:
        raise ContextParallelError(
            "context parallel needs input_ids or inputs_embeds of (B, T, ...)"
        )
    batch, length = reference.shape[:2]
    size = cp_mesh.size()
    if length % (2 * size):
        raise ContextParallelError(
            f"context parallel splits each sequence into 2 x cp = {2 * size} equal chunks "
            f"(torch's head-tail load balancing); {length} tokens do not divide"
        )
    if values.get("position_ids") is None and "position_ids" in _forward_parameters(model):
        positions = torch.arange(length, device=reference.device)
        values["position_ids"] = positions.unsqueeze(0).expand(batch, -1)
    names = [n for n in SEQUENCE_ARGUMENTS if isinstance(values.get(n), torch.Tensor)]
    balancer = _HeadTailLoadBalancer(length, size, reference.device)
    shards = _context_parallel_shard(
        cp_mesh, [values[n] for n in names], [1] * len(names), balancer
    )
    values.update(zip(names, shards, strict=True))
    return args, values


def _forward_parameters(model: nn.Module) -> Any:
    return inspect.signature(model.forward).parameters
