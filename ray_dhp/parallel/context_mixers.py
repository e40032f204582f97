"""Context parallelism for the stateful token mixers of an LM (linear attention): head-sharded by
all-to-all, so each CP rank runs the *whole* sequence for ``1 / cp`` of the mixer's heads.

A mixer that carries state along the sequence (a causal depthwise convolution, the delta rule's
recurrent state) cannot run on a sequence slice without the state of the slices before it.
Two exact ways exist: pass the state from slice to slice (chunked state passing: CP rank ``r``
waits for rank ``r - 1``'s final conv window and recurrent state, the ranks run one after the
other unless the scan is rewritten as a parallel prefix over the ranks), or re-shard by heads
as Ulysses does for attention. This module does the latter:

1. the mixer's input projections (``inputs``) run on the rank's slice with their full weights
   (the same flops as the whole sequence for ``1 / cp`` of the heads), and an all-to-all turns
   each output ``[B, S / cp, C]`` into ``[B, S, C / cp]``: the rank's piece of every *segment*
   of the fused channels (a ``[q | k | v]`` projection gives the rank ``q_h | k_h | v_h``,
   `ray_dhp.parallel.channels.segment_index`);
2. the mixer's own forward then runs unchanged on the whole sequence of those heads (its
   convolution and recurrence see every earlier token: exact), with its per-channel parameters
   (``params``) seen through the rank's pieces and its global widths (``attrs``) divided by cp;
3. the reverse all-to-all turns the input of its output projection (``output``) back into
   ``[B, S / cp, C]`` with every head, and the projection runs on the slice with its full weight.

Why not state passing: the ranks would run the mixer one after the other (CP x the latency) or
need a second, parallel-prefix formulation of the recurrence written per family, while the
head split reuses the family's TP facts, keeps every rank busy and costs two all-to-alls of the
projected channels per layer (as attention's). The limit is the same as Ulysses': ``tp x cp``
must divide the mixer's key heads.

Mechanics (hooks, no copied forward): a pre-hook on the mixer keeps its slice input aside and
hands the mixer's forward a zero-stride ``[B, S, D]`` stand-in (only its shape is read: every
projection's pre-hook replaces it by the kept slice) and no padding mask (the slice is
right-padded, the mixer causal: no real token depends on a pad, pads have no target). The
all-to-alls are `ray_dhp.parallel.ulysses.seq_to_heads` / `heads_to_seq`: each one's backward is
the other. Parameters stay replicated over the CP ranks; each rank's gradient of a per-channel
parameter is nonzero on its heads only and of a projection is its slice's share, so the sum over
the dp x cp replicas (`ray_dhp.parallel.context`) is the whole gradient. Under TP the family's
`RankChannels` has already narrowed the mixer to the TP rank's heads; the CP split is taken
inside those (segments divided by tp), and the CP hooks on the projections run before TP's
input styles (prepended) and after its output styles.

Packed rows (``data.packing``): the mixer's keyword `ray_dhp.parallel.segments.SEGMENTS_KWARG`
(``cu_seqlens`` over the whole ``R x L`` packed tokens) is taken by the pre-hook; after the
all-to-all each projection's ``[R, L, C / cp]`` is laid out in the family's aligned rows
``[R, W, C / cp]`` (``packing``, the family's stateful-mixer fact: its ``layout(mixer, cu,
length)``, a `ray_dhp.parallel.segments.SegmentLayout` with every segment at a chunk start and
zeros before it, and its ``resetter(mixer)``, which runs the mixer's recurrence with the state
reset at those starts), so the conv window and the recurrent state start at zero at every
sample as for the sample alone, and the output projection's input is laid back out as ``[R,
L, C / cp]`` before the reverse all-to-all. (`ray_dhp.models.segments.SegmentRows` does the
same without CP, on the mixer's input; under CP the input is only a stand-in, so the layout
change moves after the all-to-all.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ray_dhp.parallel.channels import segment_index
from ray_dhp.parallel.ulysses import UlyssesContext, heads_to_seq, seq_to_heads

__all__ = ["MixerHeads", "install_mixer_heads", "mixer_refusal"]

_TAG = "text.cp.mixer"


@dataclass(frozen=True)
class MixerHeads:
    """How one stateful mixer splits by head (a family fact, plain data; widths are the model's
    global ones). ``inputs``: child projection -> segments of its output channels;
    ``output``: the child projecting the mixer's channels back per token; ``params``: parameter
    path -> segments along dim 0; ``attrs``: attributes holding global widths; ``heads``:
    ``(what, count)`` the ``tp x cp`` degree must divide; ``packing``: how packed rows keep
    samples apart (module docstring; None: packed rows refused)."""

    inputs: dict
    output: str
    params: dict = field(default_factory=dict)
    attrs: tuple = ()
    heads: tuple = ()
    packing: object = None


def mixer_refusal(mixers: tuple, tp: int, cp: int):
    """Why ``cp`` cannot head-shard these mixers (None: it can)."""
    for _, spec in mixers:
        for what, count in spec.heads:
            if count % (tp * cp):
                return (f"text.tensor_parallel x text.context_parallel = {tp * cp} does not "
                        f"divide the {count} {what}")
    return None


def install_mixer_heads(language_model: torch.nn.Module, mixers: tuple, group, cp: int,
                        rank: int, tp: int = 1, comm=None, packed: bool = False) -> int:
    """Head-shard every mixer of ``language_model`` named ``*.<suffix>`` for ``(suffix,
    MixerHeads)`` in ``mixers`` over the CP ``group`` (module docstring); returns how many.
    ``packed``: every call must bring the packed segments (a model that sees only packed rows;
    a call without them raises instead of carrying state from one sample into the next)."""
    n = 0
    for suffix, spec in mixers:
        for name, m in language_model.named_modules():
            if name.endswith("." + suffix):
                _install(m, spec, group, cp, rank, tp, comm, packed)
                n += 1
    return n


def _seg(segments: tuple, tp: int) -> tuple:
    return tuple(s // tp for s in segments)


def _install(mixer, spec: MixerHeads, group, cp: int, rank: int, tp: int, comm,
             packed: bool = False) -> None:
    from ray_dhp.parallel.segments import SEGMENTS_KWARG

    state = {}
    if packed and spec.packing is None:
        raise ValueError(f"{type(mixer).__name__}: packed rows need the mixer's packing fact")
    resetter = spec.packing.resetter(mixer) if spec.packing is not None else None

    def ctx(local_len: int) -> UlyssesContext:
        return UlyssesContext(group=group, seq_lens=[local_len] * cp, rank=rank, comm=comm, tag=_TAG)

    def enter(_m, args, kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        state["local"] = h
        b, s, d = h.shape
        shape = (b, s * cp, d)
        cu = kwargs.pop(SEGMENTS_KWARG, None)
        if cu is None and packed:
            raise RuntimeError(f"{type(_m).__name__} was called without {SEGMENTS_KWARG!r}: packed "
                               "samples would share its state")
        if cu is not None:  # packed rows: the aligned rows on the whole sequence
            if resetter is None:
                raise ValueError(f"{type(_m).__name__}: packed rows need the mixer's packing fact")
            layout = spec.packing.layout(_m, cu, s * cp).to(h.device)
            if layout.to_packed.numel() != b * s * cp:
                raise ValueError(f"{SEGMENTS_KWARG} cover {layout.to_packed.numel()} tokens, the "
                                 f"mixer's rows {b} x {s * cp}")
            state["layout"] = layout
            resetter.enter(layout.starts)
            shape = (*layout.to_rows.shape, d)
        stand_in = h.new_zeros(()).expand(*shape)
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": stand_in}
        else:
            args = (stand_in, *args[1:])
        if "attention_mask" in kwargs:
            kwargs = {**kwargs, "attention_mask": None}
        _shadow(shadows)
        return args, kwargs

    def leave(m, *_):
        for key in ("local", "layout"):
            state.pop(key, None)
        _unshadow(shadows)
        if resetter is not None:
            resetter.leave(m)

    def to_heads(out, order):
        y = _to_heads(out, order, ctx(out.shape[1]))
        return y if "layout" not in state else state["layout"].rows(y)

    def to_seq(y):
        if "layout" in state:
            y = state["layout"].packed(y, state["local"].shape[0])
        return _to_seq(y, ctx(y.shape[1] // cp))

    for path, segments in spec.inputs.items():
        seg = _seg(segments, tp)
        order = torch.cat([segment_index(seg, cp, r) for r in range(cp)])
        child = mixer.get_submodule(path)
        child.register_forward_pre_hook(lambda _m, _a: (state["local"],), prepend=True)
        child.register_forward_hook(lambda _m, _a, out, order=order: to_heads(out, order))
    out_child = mixer.get_submodule(spec.output)
    out_child.register_forward_pre_hook(lambda _m, args: (to_seq(args[0]), *args[1:]), prepend=True)
    shadows = []
    for path, segments in spec.params.items():
        owner_path, _, leaf = path.rpartition(".")
        owner = mixer.get_submodule(owner_path) if owner_path else mixer
        shadows.append((owner, leaf, segment_index(_seg(segments, tp), cp, rank)))
    for attr in spec.attrs:
        value = getattr(mixer, attr)
        if value % cp:
            raise ValueError(f"{type(mixer).__name__}.{attr}={value} is not divisible by "
                             f"text.context_parallel={cp}")
        setattr(mixer, attr, value // cp)
    mixer.register_forward_pre_hook(enter, with_kwargs=True)
    mixer.register_forward_hook(leave, always_call=True)


def _to_heads(x: torch.Tensor, order: torch.Tensor, uc: UlyssesContext) -> torch.Tensor:
    """``[B, S / cp, C]`` -> ``[B, S, C / cp]``: the rank's piece of every segment (``order``
    lists every rank's channels, rank by rank)."""
    x = x.index_select(-1, order.to(x.device)).transpose(0, 1).unsqueeze(-1)  # [S_l, B, C, 1]
    return seq_to_heads(x, uc).squeeze(-1).transpose(0, 1)


def _to_seq(y: torch.Tensor, uc: UlyssesContext) -> torch.Tensor:
    """``[B, S, C / cp]`` (contiguous head blocks) -> ``[B, S / cp, C]``."""
    y = y.transpose(0, 1).unsqueeze(-1)  # [S, B, C / cp, 1]
    return heads_to_seq(y, uc).squeeze(-1).transpose(0, 1)


def _shadow(shadows: list) -> None:
    """Each per-channel parameter seen through the rank's pieces, on top of any TP view
    (`ray_dhp.parallel.channels.RankChannels` puts its view in the same place first)."""
    for owner, leaf, index in shadows:
        p = owner.__dict__.get(leaf, owner._parameters[leaf])
        owner.__dict__[leaf] = p.index_select(0, index.to(p.device))


def _unshadow(shadows: list) -> None:
    for owner, leaf, _ in shadows:
        owner.__dict__.pop(leaf, None)
