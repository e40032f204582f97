"""The language model's phase of `ray_dhp.step.engine.DHPEngine` (see `ray_dhp.step.schedule`):
the text forward/backward of a micro-batch on the text ranks, with the encoders' feature rows
in the text layout, and the feature gradients it hands back to the encoders (`EncoderPhases`,
`ray_dhp.step.encoders`). The text batch is padded, or packed with ``cfg.packing``; `TextPhase`
holds no state: it works on the engine's ``groups``, ``family``, ``text_model`` and micro-batch
states."""

from __future__ import annotations

import torch

from ray_dhp.models.contract import check_features_consumed
from ray_dhp.models.segment_attention import ATTN_NAME as SEGMENT_ATTENTION
from ray_dhp.models.segments import SEGMENTS_KWARG
from ray_dhp.step.gpu import to_device
from ray_dhp.step.loss import LossInputs, backward_loss, sample_ids_of
from ray_dhp.step.microbatch import _MicroBatch, shift_labels, upcast


class TextPhase:
    """The language model's phase and its helpers, for `DHPEngine`."""

    def _text_fwd_bwd(self, mb: "_MicroBatch", n_targets: int) -> None:
        g = self.groups
        if g.is_text:
            j, fsdp = g.text_coord[0], self.sharding.get("text")
            one = fsdp is not None or self.family.moe is not None or g.topology.text.cp > 1
            groups = mb.lay.text_groups[j] if mb.lay.text_groups and not one \
                else [mb.lay.text_samples[j]]  # FSDP, MoE: the same number of forwards per replica
            # (CP: one padded or packed batch, whose slices the boundary planned the rows of)
            if fsdp is not None:  # reduce-scatter in every backward, shards accumulate
                fsdp.sync(mb is self._states[0], mb is self._states[-1])
            mb.loss_sum, mb.grad_feats = self._text_groups(mb, mb.lay.text_samples[j], groups, n_targets)
        mb.text_feats = {}

    def _text_groups(self, mb: "_MicroBatch", mine: list, groups: list, n_targets: int):
        """The replica's samples ``mine`` run as ``groups`` (each padded to its own longest),
        one forward/backward after the other; each group takes its rows of the replica's
        features (per encoder), whose gradient accumulates over the groups. Loss sum and the
        feature gradients ``{encoder: grad}``."""
        last = mb is self._states[-1]
        if len(groups) == 1:
            self._arm_reduce("text", last)
            return self._text_forward_backward([mb.samples[i] for i in mine], mb.text_feats, n_targets)
        feats = {}
        for name, f in mb.text_feats.items():
            if f is not None and f.shape[0] > 0:
                f = f.detach().requires_grad_(self.encoder_trains(name))
            feats[name] = f
        rows = {name: mb.lay.group_rows(mine, groups, name) for name in feats}
        loss_sum = 0.0
        for n, grp in enumerate(groups):
            self._arm_reduce("text", last and n == len(groups) - 1)
            sub = {name: None if f is None else f.index_select(0, rows[name][n].to(f.device))
                   for name, f in feats.items()}
            loss, _ = self._text_forward_backward([mb.samples[i] for i in grp], sub, n_targets)
            loss_sum = loss_sum + loss
        grads = {}
        for name, f in feats.items():
            if f is not None and f.shape[0] > 0:
                check_features_consumed(f, passed=True)
            grads[name] = None if f is None else f.grad
        return loss_sum, grads

    def _text_batch(self, samples) -> dict:
        """Padded (one sample per row) or, with ``cfg.packing``, packed rows of at most
        ``cfg.max_tokens`` tokens with per-sample positions, attention and targets. With text
        sequence parallelism the length is padded to a multiple of the TP degree (`_pad_tail`:
        pad tokens come last and have no target, so the loss and gradients are unchanged)."""
        from ray_dhp.data.collate import pack_text_batch, pad_text_batch
        from ray_dhp.parallel.text_sp import pad_multiple

        pad_id = self.config.text_config.pad_token_id or 0
        topo = self.groups.topology
        multiple = pad_multiple(topo.text.inner, topo.text_sequence_parallel) * topo.text.cp
        if not self.cfg.packing:
            return _pad_tail(pad_text_batch(samples, pad_id), multiple, pad_id,
                             attended=self.family.segment_attention)
        rope = self.family.rope_index(self.text_model)  # the family's position rule
        batch = pack_text_batch(samples, pad_id, self.cfg.max_tokens, rope_index=rope,
                                one_dimensional=rope is None, pad_to_multiple_of=multiple)
        impl = self.family.language_model(self.text_model).config._attn_implementation
        if batch["input_ids"].shape[0] > 1 and impl not in _MASKED_ATTENTION + (SEGMENT_ATTENTION,) \
                and topo.text.cp == 1:  # (CP's attention takes the segments themselves, `ray_dhp.parallel.context`)
            raise ValueError(
                f"packing into several rows needs a mask-based attention ({_MASKED_ATTENTION}); "
                f"{impl!r} detects packed samples from positions only in a single row: set "
                f"max_tokens=None (one row per micro-batch) or use attn_implementation='sdpa'."
            )
        return batch

    def _text_logits(self, samples, feats: dict):
        """The text forward of ``samples`` with ``feats`` (``{encoder: rows}``, their features
        in the text layout): the batch, the features as handed in per encoder (those with
        rows) and the (vocab-sharded) logits. Shared by training and `ray_dhp.step.evaluation`."""
        dev, cp = self.groups.device, self.groups.topology.text.cp
        batch = self._text_batch(samples)
        if cp > 1:  # this rank's slice of the sequence (`_context_slice`)
            batch = self._context_slice(batch, samples)
        handed, extra = {}, {"mm_encoder_outputs": None}
        for name, f in feats.items():
            if f is None or f.shape[0] == 0:
                continue
            if torch.is_grad_enabled() and self.encoder_trains(name) and not f.requires_grad:
                f.requires_grad_(True)
            handed[name] = f
            ops = self.family.encoder_spec(name).operations()  # the stock forward's own seam
            rows = {} if cp == 1 else {"rows": self._context_rows(ops, samples, batch["full_length"])}
            extra.update(ops.text_inputs(self.family, self.config, self.text_model, samples, f, dev,
                                         **rows))
        grid, mask, pos = batch["image_grid_thw"], batch["attention_mask"], batch.get("position_ids")
        videos = {} if batch.get("video_grid_thw") is None else \
            {"video_grid_thw": to_device(batch["video_grid_thw"], dev)}
        seconds = self.family.video_seconds_key  # families with absolute-time M-RoPE name it
        if batch.get("second_per_grid_ts") is not None and _accepts(self.text_model, seconds):
            videos[seconds] = to_device(batch["second_per_grid_ts"], dev)
        if batch.get("cu_seqlens") is not None and (self.family.stateful_mixers or cp > 1 or self._segment_attention):
            extra[SEGMENTS_KWARG] = batch["cu_seqlens"]  # the mixers' / attention's (CP's too) segments
        with self._autocast(), self._row_reads():
            out = self.text_model(**self.family.lm_inputs(self.config, dict(
                input_ids=to_device(batch["input_ids"], dev),
                attention_mask=None if mask is None else to_device(mask, dev),
                position_ids=None if pos is None else to_device(pos, dev),
                mm_token_type_ids=to_device(batch["mm_token_type_ids"], dev),
                image_grid_thw=None if grid is None else to_device(grid, dev),
                use_cache=False, **videos, **extra)))
        return batch, handed, out.logits

    def _row_reads(self):
        """`ShardedRowReads` where the family's text forward reads rows of its embedding table
        outside the embedding (`GenericFamily.text_reads_table`): a vocabulary-parallel or ZeRO-3
        table then serves them row by row, never gathered whole."""
        import contextlib

        from ray_dhp.parallel.table_rows import ShardedRowReads

        return ShardedRowReads() if getattr(self.family, "text_reads_table", "") else \
            contextlib.nullcontext()

    def _text_forward_backward(self, samples, feats: dict, n_targets: int):
        dev, router = self.groups.device, self._router_loss
        if router is not None:
            router.record(True)
        batch, handed, logits = self._text_logits(samples, feats)
        targets = batch["targets"] if "targets" in batch else shift_labels(batch["labels"])
        sample_ids = sample_ids_of(batch, samples).to(dev)
        inputs = LossInputs(upcast(logits), targets.to(dev), sample_ids,
                            list(samples), n_targets, self._num_samples)
        extra = None if router is None else router.contribution(sample_ids >= 0, len(self._states))
        value = backward_loss(self._loss_fn, inputs, self.groups.topology.text.inner > 1, extra)
        grads = {}
        for name, f in feats.items():
            check_features_consumed(f, passed=name in handed)
            grads[name] = f.grad if name in handed and f.is_leaf else None
        return value, grads


    # -- the LM's context parallelism (`ray_dhp.parallel.context`): this CP rank's slice of a
    # padded or packed batch, positions computed per sample on the whole row

    def _context_slice(self, batch: dict, samples) -> dict:
        """The rank's contiguous ``1/cp`` of every per-token tensor of the padded or packed
        ``batch`` (each row sliced): tokens, token types, next-token targets (shifted within each
        sample on the whole row), sample ids and positions (each sample's own, by the family's
        rope rule, then sliced); no attention mask (causal over the whole sequence, or per
        packed segment, `cp_attention`), no grids (positions are given); a packed batch keeps
        its ``cu_seqlens`` over the whole rows."""
        from ray_dhp.data.collate import positions_dtype, sample_positions
        from ray_dhp.parallel.context import slice_sequence

        cp, c = self.groups.topology.text.cp, self.groups.text_cp_rank
        rows, length = batch["input_ids"].shape
        planned, _ = self._context_layout(samples)
        if length != planned:  # the boundary planned the rows for it
            raise RuntimeError(f"text batch of length {length}, planned {planned}")
        cut = lambda t: slice_sequence(t, cp, c)  # noqa: E731
        if batch.get("cu_seqlens") is not None:  # packed: positions per sample on the whole row
            pos = batch["position_ids"]
            pos = pos[1:] if pos.dim() == 3 else pos  # M-RoPE: no text row (no packed mask built)
            return {"input_ids": cut(batch["input_ids"]), "mm_token_type_ids": cut(batch["mm_token_type_ids"]),
                    "targets": cut(batch["targets"]), "sample_ids": cut(batch["sample_ids"]),
                    "position_ids": cut(pos), "attention_mask": None, "image_grid_thw": None,
                    "full_length": length, "cu_seqlens": batch["cu_seqlens"]}
        rope = self.family.rope_index(self.text_model)
        if rope is None:  # 1-D positions
            pos = torch.arange(length).expand(rows, length)
        else:
            own = [sample_positions(s, rope, False) for s in samples]  # long, or fractional times
            pos = torch.zeros(3, rows, length, dtype=positions_dtype(own))
            for i, (s, p) in enumerate(zip(samples, own)):
                pos[:, i, :s.num_tokens] = p
        return {"input_ids": cut(batch["input_ids"]), "mm_token_type_ids": cut(batch["mm_token_type_ids"]),
                "targets": cut(shift_labels(batch["labels"])),
                "sample_ids": cut(sample_ids_of(batch, samples)), "position_ids": cut(pos),
                "attention_mask": None, "image_grid_thw": None, "full_length": length}

    def _context_layout(self, samples) -> tuple:
        """``(length, starts)``: the row length `_text_batch` gives ``samples`` (padded: the
        longest; packed: the fullest row of `pack_rows`, the samples in the layout's
        `pack_order`), rounded up to the sequence-parallel x
        context-parallel multiple, and each sample's first column in its row."""
        from ray_dhp.data.collate import pack_rows
        from ray_dhp.parallel.text_sp import pad_multiple

        topo = self.groups.topology
        multiple = pad_multiple(topo.text.inner, topo.text_sequence_parallel) * topo.text.cp
        sizes = [int(s.num_tokens) for s in samples]
        if not self.cfg.packing:
            return -(-max(sizes) // multiple) * multiple, [0] * len(samples)
        starts, longest = [], 0
        for r in pack_rows(sizes, self.cfg.max_tokens):
            used = 0
            for i in r:
                starts.append(used)
                used += sizes[i]
            longest = max(longest, used)
        return -(-longest // multiple) * multiple, starts

    def _context_rows(self, ops, samples, length: int) -> torch.Tensor:
        """Which of ``samples``' feature rows of an encoder (``ops``) fall in this CP rank's
        slice of the rows of ``length`` (the rows the boundary delivered here)."""
        from ray_dhp.parallel.context import local_rows

        _, starts = self._context_layout(samples)
        return local_rows([ops.row_tokens(s) for s in samples], length,
                          self.groups.topology.text.cp, self.groups.text_cp_rank, starts)


def _pad_tail(batch: dict, multiple: int, pad_id: int, attended: bool = True) -> dict:
    """Right-pad a padded batch to a length that is a multiple of ``multiple`` (text sequence
    parallelism). The tail is *attended* (mask 1): under causal attention no real token sees a
    later one, and the tail has no targets, so the loss and gradients are unchanged — and a batch
    without padding keeps an all-ones mask, so attention stays mask-free (``is_causal``) instead
    of materialising an ``S x S`` mask. Not ``attended`` (mask 0): a family whose attention is
    not plain causal (`FamilySpec.segment_attention` False: a prefix LM's bidirectional prefix
    would let the real tokens see an attended tail)."""
    length = batch["input_ids"].shape[1]
    extra = -length % multiple
    if not extra:
        return batch
    fill = {"input_ids": pad_id, "attention_mask": int(attended), "labels": -100,
            "mm_token_type_ids": 0}
    out = dict(batch)
    for key, value in fill.items():
        t = batch[key]
        out[key] = torch.cat([t, t.new_full((t.shape[0], extra), value)], dim=1)
    return out


# Attention implementations whose mask transformers builds from packed position ids for any
# number of rows (flash kernels infer packing from positions only when there is one row).
_MASKED_ATTENTION = ("sdpa", "eager", "flex_attention")


def _accepts(model, name: str) -> bool:
    """Whether the model's forward takes ``name`` (the videos' seconds, for the
    families whose M-RoPE uses absolute time); a PEFT wrapper is looked through."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return name in inspect.signature(base.forward).parameters
