"""Expert parallelism: an MoE layer whose experts are split over the ranks of a process group.

Each rank holds ``num_experts / world_size`` experts as two ``GroupedLinear`` layers and
routes its own tokens. A forward pass:

1. routes: router logits -> softmax -> top-k; the ``T * top_k`` routed rows are sorted by
   expert, so rows for one rank are contiguous (rank r holds experts
   ``[r * L, (r + 1) * L)``, ``L = num_experts / world_size``);
2. exchanges the per-expert row counts (``all_to_all`` of ``world_size * L`` integers;
   one host sync, since ``all_to_all_single`` takes its split sizes as Python ints);
   the first forward (or ``full_state_dict``) also gathers every rank's configuration
   (``num_experts``, ``hidden``, ``ffn``, dtype, ..., and a fingerprint of the replicated
   router) and raises on every rank if they differ;
3. dispatches the rows (``all_to_all``), re-sorts what arrived by local expert, runs
   gate-up -> activation -> down with the received counts as ``m_splits``;
4. combines (the reverse ``all_to_all``) and sums each token's ``top_k`` expert outputs
   weighted by the router.

Every exchange is differentiable (``all_to_all``: its backward is the reverse exchange).
With ``process_group=None`` and no initialised default group the layer is a plain
single-process MoE layer (no collectives, device-resident splits, no host sync).
Collectives use the group's timeout (``init_process_group(timeout=...)``): a rank that
fails raises, the others wait for that timeout and then raise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from grouped_gemm.errors import (
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    InvalidTypeError,
    ShapeError,
)
from grouped_gemm.group_offsets import as_ints
from grouped_gemm.nn import GroupedLinear
from grouped_gemm.recipe_codec import recipe_key
from grouped_gemm.recipes import Recipe
from grouped_gemm.validation import META_REFUSAL

# name -> (gated, elementwise function). Gated activations split gate-up's output in two
# halves, ``act(gate) * up``, so gate-up has ``2 * ffn`` outputs.
ACTIVATIONS: dict[str, tuple[bool, Callable[[torch.Tensor], torch.Tensor]]] = {
    "swiglu": (True, F.silu),
    "geglu": (True, F.gelu),
    "gelu": (False, F.gelu),
    "relu": (False, F.relu),
}
#: Room for a recipe key in the configuration table ``_check_peers`` gathers (the longest,
#: a built-in's name with a changed scale_rule and grad_format, has 39 bytes).
_RECIPE_BYTES = 64
_EXPERT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _exchange(
    rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single``: backward sends the gradients back, splits swapped."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits = (send_splits, recv_splits)
        ctx.group = group
        return _exchange(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        send_splits, recv_splits = ctx.splits
        return _exchange(grad, recv_splits, send_splits, ctx.group), None, None, None


def all_to_all(
    rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Send ``send_splits[r]`` consecutive rows of ``rows`` to rank r of ``group`` and return
    the ``recv_splits[r]`` rows from each rank r, in rank order; differentiable.

    Every rank must call it, and (under autograd) run its backward, the same number of times.
    Each rank's splits are checked before the exchange: a negative size makes the collective
    read and write out of bounds, and the rows a rank sends itself must be the rows it
    receives from itself. (That rank r's ``send_splits`` equals what rank r's peers expect in
    ``recv_splits`` cannot be checked without another collective.)
    """
    if not isinstance(rows, torch.Tensor):
        raise InvalidTypeError("rows", rows, "a torch.Tensor of rows to send")
    if rows.dim() == 0:
        raise ShapeError("rows", rows, "a tensor of at least one dimension (rows to send)")
    _check_member("group", group)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise InvalidTypeError("group", group, "a torch.distributed ProcessGroup (None: the default group)")
    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgumentError(
            "group", group, "a ProcessGroup, or None once torch.distributed.init_process_group has run"
        )
    world = dist.get_world_size(group)
    send = _rank_splits("send_splits", send_splits, world)
    recv = _rank_splits("recv_splits", recv_splits, world)
    if sum(send) != rows.shape[0]:
        raise InvalidArgumentError("send_splits", send, f"sizes summing to rows.shape[0]={rows.shape[0]}")
    me = dist.get_rank(group)
    if send[me] != recv[me]:  # the one pair a rank can check alone: the rows it keeps
        raise InvalidArgumentError(
            "recv_splits", recv, f"recv_splits[{me}] == send_splits[{me}]={send[me]} (this rank's rows to itself)"
        )
    return _AllToAll.apply(rows, send, recv, group)


def _rank_splits(name: str, splits: Any, world: int) -> list[int]:
    """``splits`` as ``world`` non-negative ints in rank order: a list, tuple or 1-D tensor
    of ints, numpy ints or 1-element integer tensors (items as ``m_splits``' are checked).
    A mapping or set is refused (its keys, or an arbitrary order, were read as the sizes),
    and so is a bool or bool-tensor item (a bool tensor counted as 1)."""
    allowed = f"{world} non-negative ints, one per rank of the group, in rank order"
    if isinstance(splits, (Mapping, AbstractSet, str, bytes)) or not isinstance(splits, Iterable):
        raise InvalidArgumentError(name, splits, allowed)
    values = as_ints(list(splits), name)
    if len(values) != world or any(v < 0 for v in values):
        raise InvalidArgumentError(name, splits, allowed)
    return values


@dataclasses.dataclass(frozen=True)
class Routing:
    """One forward pass's routing on this rank (what ``ExpertParallelMoE.route`` returns).

    Rows are this rank's ``T * top_k`` (token, expert) pairs sorted by expert.
    ``token[i]`` / ``weight[i]``: source token and router weight of sorted row i.
    ``send_splits[r]``: rows sent to rank r; ``recv_splits[r]``: rows received from it.
    ``expert_splits``: received rows per local expert (the experts' ``m_splits``).
    ``order``: received rows -> rows grouped by local expert (None when already grouped).
    """

    token: torch.Tensor
    weight: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    expert_splits: list[int] | torch.Tensor
    order: torch.Tensor | None


def _fingerprint(t: torch.Tensor) -> list[int]:
    """Two integers that tell bitwise different tensors of one shape and dtype apart: the
    sum of their bytes, and that sum weighted by position (a permutation changes it).
    Integer sums are exact in any order, so every rank gets the same numbers for the same
    tensor (a float sum depends on the reduction order, e.g. on the thread count)."""
    bits = t.detach().contiguous().flatten().view(torch.uint8).long()  # any dtype: its bytes
    place = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return [int(bits.sum()), int((bits * place).sum())]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(name, value, "a positive integer")
    return value


def _check_member(name: str, group: Any) -> None:
    """``dist.new_group`` returns the int ``GroupMember.NON_GROUP_MEMBER`` (-100) on ranks it
    leaves out: named as such, not as "not a ProcessGroup", which hides why."""
    if (
        type(group) is int
        and dist.is_available()
        and dist.is_initialized()
        and group == dist.GroupMember.NON_GROUP_MEMBER
    ):
        raise InvalidArgumentError(
            name,
            f"GroupMember.NON_GROUP_MEMBER ({group})",
            f"a group this rank (global rank {dist.get_rank()}) belongs to: dist.new_group returns "
            "NON_GROUP_MEMBER on the ranks it leaves out, which must not use the group",
        )


def _resolve_group(process_group: Any) -> dist.ProcessGroup | None:
    """The group to use: the given one, the default group if initialised, else None (local)."""
    if process_group is None:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    _check_member("process_group", process_group)
    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise InvalidTypeError("process_group", process_group, "a torch.distributed ProcessGroup or None")
    return process_group


class ExpertParallelMoE(torch.nn.Module):
    """Top-k routed MoE layer, experts split evenly over ``process_group``.

    ``forward(x)``: this rank's tokens ``(T, hidden)`` -> ``(T, hidden)``; T may differ
    between ranks and may be 0. Every rank of the group must call forward (and backward)
    together. The group is fixed at construction: ``None`` means the default group if one
    is initialised then, else none (a local layer); a group of one (e.g. from
    ``dist.new_subgroups(group_size=1)``) also gives the local layer inside a distributed job.

    Parameters: ``router.weight`` ``(num_experts, hidden)``, replicated (the same on every
    rank, checked at the first forward: seed the ranks alike or load one state; each rank's
    gradient covers its own tokens: sum it over the group, as data-parallel training
    does, to get the whole batch's); ``gate_up`` and ``down`` are ``GroupedLinear``
    layers holding this rank's ``num_experts / world_size`` experts. ``state_dict()`` is
    this rank's shard; ``full_state_dict()`` gathers the whole layer and
    ``load_full_state_dict()`` loads one, so a single-process layer and an
    expert-parallel one can hold the same experts.

    ``activation``: ``"swiglu"`` / ``"geglu"`` (gate-up has ``2 * ffn`` outputs, the
    first half is the gate) or ``"gelu"`` / ``"relu"``. ``recipe``, ``dtype``, ``device``
    and ``bias`` go to both ``GroupedLinear`` layers (without a recipe they compute in
    ``dtype``, bf16 when neither is given); the router uses their parameter dtype.
    ``normalize_weights``: rescale each token's top-k router weights to sum to 1.
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        top_k: int,
        *,
        process_group: dist.ProcessGroup | None = None,
        recipe: str | Recipe | None = None,
        activation: str = "swiglu",
        bias: bool = False,
        normalize_weights: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = _positive("num_experts", num_experts)
        self.hidden = _positive("hidden", hidden)
        self.ffn = _positive("ffn", ffn)
        self.top_k = _positive("top_k", top_k)
        if top_k > num_experts:
            raise InvalidArgumentError("top_k", top_k, f"at most num_experts={num_experts}")
        if not isinstance(activation, str) or activation not in ACTIVATIONS:
            raise InvalidArgumentError("activation", activation, f"one of {sorted(ACTIVATIONS)}")
        if not isinstance(normalize_weights, bool):
            raise InvalidTypeError("normalize_weights", normalize_weights, "True or False")
        self.activation = activation
        self.normalize_weights = normalize_weights
        self.group = _resolve_group(process_group)
        self.world_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        if num_experts % self.world_size:
            raise InvalidArgumentError(
                "num_experts",
                num_experts,
                f"a multiple of the process group's size {self.world_size} (experts are split evenly over ranks)",
            )
        self.local_experts = num_experts // self.world_size
        gated = ACTIVATIONS[activation][0]
        linear = {"bias": bias, "recipe": recipe, "dtype": dtype, "device": device}
        self.gate_up = GroupedLinear(self.local_experts, hidden, (2 if gated else 1) * ffn, **linear)
        self.down = GroupedLinear(self.local_experts, ffn, hidden, **linear)
        param = self.gate_up.weights[0]
        self.router = torch.nn.Linear(hidden, num_experts, bias=False, dtype=param.dtype, device=param.device)
        self._peers_agree = False

    @property
    def expert_range(self) -> range:
        """The global indices of the experts this rank holds."""
        return range(self.rank * self.local_experts, (self.rank + 1) * self.local_experts)

    def _check_input(self, x: Any) -> None:
        if not isinstance(x, torch.Tensor):
            raise InvalidTypeError("x", x, "a torch.Tensor of shape (tokens, hidden)")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ShapeError("x", x, f"shape (tokens, {self.hidden})")
        param = self.router.weight
        if x.dtype != param.dtype:
            raise DTypeError("x", x, f"dtype {param.dtype}, the layer's parameter dtype")
        if x.device != param.device:
            raise DeviceMismatchError("x", x, f"a tensor on {param.device}, where the layer's parameters are")
        # Both failed only in the experts, after the exchange, naming the dispatched rows as x.
        if x.is_meta:
            raise DeviceMismatchError("x", x, META_REFUSAL)
        if param.dtype not in _EXPERT_DTYPES:
            raise DTypeError(
                "router.weight",
                param,
                "parameters in bfloat16, float16 or float32 (what the experts compute in); "
                f"the layer was cast to {param.dtype}",
            )

    def route(self, x: torch.Tensor) -> Routing:
        """Route this rank's tokens and exchange the row counts with the other ranks."""
        self._check_input(x)
        # fp32 logits: 16-bit ones tie often, and a tie broken differently changes an expert.
        probs = F.linear(x.float(), self.router.weight.float()).softmax(dim=-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize_weights:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()
        sort = torch.argsort(flat, stable=True)
        token = sort // self.top_k
        weight = weight.flatten()[sort]
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        if self.group is None or self.world_size == 1:
            n = int(flat.numel())
            return Routing(token, weight, [n], [n], counts, None)
        if not self._peers_agree:
            self._check_peers()
        # received[s, e]: rows rank s sends to this rank's local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        host = torch.stack([counts, received]).view(2, self.world_size, self.local_experts).tolist()
        send_splits = [sum(per_rank) for per_rank in host[0]]
        recv_splits = [sum(per_rank) for per_rank in host[1]]
        expert_splits = [sum(col) for col in zip(*host[1], strict=True)]
        local = torch.arange(self.local_experts, device=x.device).repeat(self.world_size)
        expert_of_row = torch.repeat_interleave(local, received)
        order = torch.argsort(expert_of_row, stable=True)
        return Routing(token, weight, send_splits, recv_splits, expert_splits, order)

    def _check_peers(self) -> None:
        """Once, before the first exchange or gather: every rank's layer must be the same
        layer. A rank with another num_experts, hidden or dtype sends sizes the others do
        not expect (gloo aborts the process; a mixed 16-bit dtype would be read as garbage),
        another ffn or bias gathers shards that do not fit; another recipe or
        normalize_weights runs silently as another layer on that rank's experts or tokens,
        and so does another router (ranks seeded apart build different ones).
        Every rank gathers the same table, so all raise together and none hangs."""
        dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
        activations = sorted(ACTIVATIONS)
        device, dtype = self.router.weight.device, self.router.weight.dtype
        decode: dict[str, Callable[[Any], Any]] = {
            "bias": bool,
            "normalize_weights": bool,
            "activation": activations.__getitem__,
            "dtype": lambda i: dtypes[i] if i >= 0 else "another dtype",
            "recipe": lambda codes: bytes(codes).rstrip(b"\0").decode(),
        }
        mine: dict[str, Any] = {
            "num_experts": self.num_experts,
            "hidden": self.hidden,
            "ffn": self.ffn,
            "top_k": self.top_k,
            "bias": int(self.gate_up.use_bias),
            "normalize_weights": int(self.normalize_weights),
            "activation": activations.index(self.activation),
            "dtype": dtypes.index(dtype) if dtype in dtypes else -1,
            # The recipe key's bytes (a built-in's name, plus a changed scale_rule / grad_format).
            "recipe": list(recipe_key(self.gate_up.recipe).encode().ljust(_RECIPE_BYTES, b"\0")),
            # Last: its shape and dtype agree once every field above does.
            "router.weight": _fingerprint(self.router.weight),
        }
        row = [v for value in mine.values() for v in (value if isinstance(value, list) else [value])]
        table = [torch.empty(len(row), dtype=torch.int64, device=device) for _ in range(self.world_size)]
        dist.all_gather(table, torch.tensor(row, device=device), group=self.group)
        for rank, t in enumerate(table):
            theirs = iter(t.tolist())
            for name, value in mine.items():
                other = [next(theirs) for _ in value] if isinstance(value, list) else next(theirs)
                if value == other:
                    continue
                if name == "router.weight":  # a fingerprint: name the tensor, not two sums
                    raise InvalidArgumentError(
                        name,
                        self.router.weight,
                        f"the same on every rank of the group (the router is replicated), but rank {rank}'s "
                        "differs: build the layer after seeding every rank alike, or load one state on "
                        "every rank (load_full_state_dict)",
                    )
                show = decode.get(name, int)
                raise InvalidArgumentError(
                    name,
                    show(value),
                    f"the same on every rank of the group, like rank {rank}'s {show(other)} (one layer)",
                )
        self._peers_agree = True

    def experts(self, rows: torch.Tensor, m_splits: list[int] | torch.Tensor) -> torch.Tensor:
        """This rank's experts on rows grouped by local expert: gate-up -> activation -> down."""
        gated, act = ACTIVATIONS[self.activation]
        h = self.gate_up(rows, m_splits)
        if gated:
            gate, up = h.chunk(2, dim=-1)
            h = act(gate) * up
        else:
            h = act(h)
        return self.down(h, m_splits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.route(x)
        rows = x[r.token]
        if self.group is not None and self.world_size > 1:
            if torch.is_grad_enabled() and not rows.requires_grad:
                # Every rank must run the dispatch's backward exchange together; make it
                # part of the graph here too, even though x needs no gradient on this rank.
                rows = rows.detach().requires_grad_(True)
            rows = all_to_all(rows, r.send_splits, r.recv_splits, self.group)
        if r.order is not None:
            y = self.experts(rows[r.order], r.expert_splits)
            inverse = torch.empty_like(r.order)
            inverse[r.order] = torch.arange(r.order.numel(), device=r.order.device)
            y = y[inverse]
        else:
            y = self.experts(rows, r.expert_splits)
        if self.group is not None and self.world_size > 1:
            y = all_to_all(y, r.recv_splits, r.send_splits, self.group)
        y = y * r.weight[:, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, r.token, y)

    def _expert_keys(self) -> list[str]:
        return [k for k in self.state_dict() if k.startswith(("gate_up.", "down."))]

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load a whole layer's state (e.g. a single-process layer's ``state_dict()``):
        the router as is, this rank's slice of every expert tensor. No collective."""
        if not isinstance(state, Mapping):
            raise InvalidTypeError("state", state, "a mapping of names to tensors (a whole layer's state_dict())")
        expected = set(self.state_dict())
        if set(state) != expected:
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            raise InvalidArgumentError(
                "state", f"missing keys {missing}, unexpected keys {unexpected}", f"exactly the keys {sorted(expected)}"
            )
        # Checked here, not left to load_state_dict: its RuntimeError names no allowed shape,
        # and it would silently cast integer or complex tensors into the parameters.
        expert_keys = set(self._expert_keys())
        local = {}
        for key, mine in self.state_dict().items():
            full, name, stacked = state[key], f"state[{key!r}]", key in expert_keys
            note = f" (num_experts={self.num_experts} experts' tensors, stacked)" if stacked else ""
            if not isinstance(full, torch.Tensor):
                raise InvalidTypeError(name, full, "a tensor" + note)
            if not full.is_floating_point():
                raise DTypeError(name, full, "a floating-point tensor (it is copied into a parameter)")
            if full.is_meta:
                raise InvalidArgumentError(name, full, "a tensor with data (not on the meta device)")
            shape = (self.num_experts, *mine.shape[1:]) if stacked else tuple(mine.shape)
            if tuple(full.shape) != shape:
                raise ShapeError(name, full, f"shape {shape}{note}")
            local[key] = full[self.expert_range.start : self.expert_range.stop] if stacked else full
        self.load_state_dict(local)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole layer's state, every expert gathered from every rank (a collective:
        every rank calls it and gets the same dict)."""
        state = {k: v.detach().clone() for k, v in self.state_dict().items()}
        if self.group is None or self.world_size == 1:
            return state
        if not self._peers_agree:
            self._check_peers()
        for key in self._expert_keys():
            shard = state[key].contiguous()
            parts = [torch.empty_like(shard) for _ in range(self.world_size)]
            dist.all_gather(parts, shard, group=self.group)
            state[key] = torch.cat(parts)
        return state

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden}, ffn={self.ffn}, top_k={self.top_k}, "
            f"activation={self.activation}, world_size={self.world_size}, rank={self.rank}, "
            f"experts={self.expert_range.start}..{self.expert_range.stop - 1}"
        )
