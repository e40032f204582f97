"""The encoders' phases of `ray_dhp.step.engine.DHPEngine` (see `ray_dhp.step.schedule`): each
encoder module's forward on its ranks, its boundary exchange of feature rows into the text
layout, and the feature gradients back with the encoder's backward.

Every phase walks the encoders in module order (`Topology.encoders`), the same on every rank, so
each encoder's exchange is one exchange in the same place everywhere (`ray_dhp.parallel.boundary`
orders a pair's messages so that this holds under NCCL). Every encoder — the vision side first,
then e.g. an audio tower — is reached through its `EncoderSpec` operations (its rows,
shard plans, inputs and forward) and its ZeRO-3 sharding, if any (``sharding[name]``).
`EncoderPhases` holds no state: it works on the engine's ``groups``, ``family``, ``shards``,
``sharding`` and micro-batch states.
"""

from __future__ import annotations

from typing import Optional

import torch

from ray_dhp.parallel import boundary as bnd
from ray_dhp.step.gpu import to_device
from ray_dhp.step.microbatch import MicroBatchLayout, _MicroBatch, layout_micro_batch


class EncoderPhases:
    """The encoders' phases and their helpers, for `DHPEngine`."""

    def _vision_fwd(self, mb: "_MicroBatch", n_targets: int) -> None:
        """The encoders' forward (phase name kept: the vision side is the first encoder)."""
        g = self.groups
        mb.lay = layout_micro_batch(mb.samples, g.topology, self.family,
                                    self.config, self.balancer())
        self._note_inputs(mb)
        for m in g.topology.encoders:
            if g.hosts(m.name) and mb.inputs[m.name]:
                with self._autocast(), torch.set_grad_enabled(self.encoder_trains(m.name)):
                    mb.feats[m.name] = self._encoder_forward(m.name, mb.samples, mb.lay)

    def _send_features(self, mb: "_MicroBatch", n_targets: int) -> None:
        g = self.groups
        for m in g.topology.encoders:
            if not mb.inputs[m.name]:
                continue
            lay = mb.lay.encoders[m.name]
            plan = mb.plan[m.name] = bnd.plan_boundary(g.topology, g.rank, self._held_rows(m, lay),
                                                       self._needed_rows(mb.lay, m.name, mb.samples))
            feats = mb.feats.get(m.name)
            local = None if feats is None else feats.detach().to(self.dtype)
            mb.text_feats[m.name] = bnd.features_forward(
                plan, local, self.feature_dims[m.name], self.dtype, g.device, comm=self.comm,
                inflight=self._inflight)


    def _return_grads(self, mb: "_MicroBatch", n_targets: int) -> None:
        g = self.groups
        for m in g.topology.encoders:
            name = m.name
            if not mb.inputs[name]:
                continue
            feats = mb.feats.pop(name, None)
            if not self.encoder_trains(name):  # frozen encoder: no feature gradients go back
                continue
            n_local = 0 if feats is None else feats.shape[0]
            g_local = bnd.features_backward(mb.plan[name], mb.grad_feats.get(name), n_local,
                                            self.feature_dims[name], self.dtype, g.device,
                                            comm=self.comm, inflight=self._inflight)
            if feats is not None:  # also with 0 local rows: the SP all-to-alls run in backward
                last = mb is self._last_with(name)
                self._arm_reduce(name, last)
                sharded = self.sharding.get(name)
                if sharded is not None:  # stage 3: reduce-scatter in every backward
                    sharded.sync(mb is self._first_with(name), last)
                with self._timer(f"{name}_bwd"):
                    feats.backward(g_local.to(feats.dtype))
        mb.feats, mb.grad_feats = {}, {}

    def _note_inputs(self, mb: "_MicroBatch") -> None:
        """Which encoders have input in ``mb`` (plain data: the same on every rank)."""
        for m in self.groups.topology.encoders:
            if m.name not in mb.inputs:
                ops = self.family.encoder_spec(m.name).operations()
                mb.inputs[m.name] = any(ops.has_input(s) for s in mb.samples)

    def _first_with(self, name: str):
        """The step's first micro-batch state with input for encoder ``name``."""
        return next((s for s in self._states if s.inputs.get(name)), None)

    def _last_with(self, name: str):
        """The step's last micro-batch state with input for encoder ``name``: its last backward."""
        return next((s for s in reversed(self._states) if s.inputs.get(name)), None)

    def encoder_trains(self, name: str) -> bool:
        """Does any parameter of encoder ``name`` train (any of its ``modules:`` entries)? If
        not, no feature gradient crosses its boundary and its forward keeps no graph."""
        spec = self.family.encoder_spec(name)
        return any(self.tuning.choice(t).train for t in spec.tuning_modules)

    def _encoder_forward(self, name: str, samples, lay: MicroBatchLayout) -> Optional[torch.Tensor]:
        """This rank's rows of encoder ``name`` (its operations' ``forward`` on its replica's
        samples with input, its inner rank's share of the plan)."""
        i, k = self.groups.coord(name)
        el = lay.encoders[name]
        sharded = self.sharding.get(name)
        if el.plans[i] is None:  # no input here; at stage 3 the module's collectives still run
            return None if sharded is None else sharded.idle()
        ops = self.family.encoder_spec(name).operations()
        mine = [samples[s] for s in el.samples[i] if ops.has_input(samples[s])]
        inputs = {key: to_device(v, self.groups.device) for key, v in ops.inputs(mine).items()}
        return ops.forward(self.family, self.shards[name], inputs, el.plans[i], self.dtype,
                           sp_rank=k, sp_group=self.groups.encoders[name].sp, comm=self.comm,
                           sharded=sharded)

    def _held_rows(self, m, lay) -> dict:
        """World rank -> the feature rows it computes of encoder ``m`` (`ModuleLayout`), in its
        local order (its operations' ``local_rows``: the vision side's SP cuts, or a replica's
        rows whole)."""
        ops = self.family.encoder_spec(m.name).operations()
        held = {}
        for i, plan in enumerate(lay.plans):
            rows = lay.rows_of(lay.samples[i])  # the replica's local row -> global row
            for k in range(m.inner):
                held[m.rank_at(i, k)] = (torch.zeros(0, dtype=torch.long) if plan is None
                                         else ops.local_rows(plan, k, rows))
        return held

    def _needed_rows(self, lay: MicroBatchLayout, name: str, samples: list) -> dict:
        """Text world rank -> the rows of encoder ``name`` its replica's samples consume; with
        context parallelism only those whose tokens fall in the rank's slice of the replica's
        padded or packed rows (`ray_dhp.parallel.context.local_rows`)."""
        t = self.groups.topology.text
        if t.cp == 1:
            return {t.rank_at(j, k): lay.rows_of(idx, name)
                    for j, idx in enumerate(lay.text_samples) for k in range(t.inner)}
        from ray_dhp.parallel.boundary import _ids
        from ray_dhp.parallel.context import local_rows

        ops, out = self.family.encoder_spec(name).operations(), {}
        for j, idx in enumerate(lay.text_samples):
            mine_s = [samples[i] for i in idx]
            length, starts = self._context_layout(mine_s)  # as `_text_batch` lays them out
            rows = _ids(lay.rows_of(idx, name))
            for c in range(t.cp):
                mine = rows[local_rows([ops.row_tokens(s) for s in mine_s], length, t.cp, c, starts)]
                out.update({t.rank_at(j, k, c): mine for k in range(t.inner)})
        return out

