"""The open loop: `forward_backward` + `optimizer_step` is `step()`, and a custom loss trains
exactly like the single-process reference with the same loss (`ray_dhp.step.loss` contract).

fp64 throughout, on the parity harness's batches (3 steps, 2 micro-batches of 4 samples mixing
image sizes and a text-only sample, clipping active). Tolerance 1e-10 relative, as in
test_parity (fp64 differences are summation orders only, ~1e-14); a loss that sees the wrong
rows, misses a replica or double counts over TP ranks is off by O(1e-2) or more.

The custom losses:
* ``image_weighted_loss``: the token loss of samples with an image weighs double, from
  ``inputs.token_loss()``, ``inputs.sample_ids`` and ``inputs.samples`` (per-sample weights need
  the right sample of every position, also when packed rows hold several samples);
* ``smoothed_loss``: label-smoothed cross-entropy plus a z-loss, from ``inputs.logsumexp()`` and
  ``inputs.mean_logit()`` (computed on the vocab shards; its definition is checked against
  ``F.cross_entropy(label_smoothing=0.1)`` on plain logits in `test_smoothed_loss_is_torchs`).
"""

import pytest
import torch
import torch.nn.functional as F

from ray_dhp import demo
from ray_dhp.step.loss import cross_entropy_loss
from ray_dhp.step.reference import ReferenceTrainer
from ray_dhp.parallel.topology import Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import assert_parity, capture_grads, make_steps, merge_ranks
from tests.spawn import run_on_ranks

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=3,
                      max_grad_norm=0.5, weight_decay=0.1, lr_schedule="cosine", warmup_steps=1)
FAMILY = "qwen2_5_vl"
TOL = dict(loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)


def image_weighted_loss(inputs):
    """Token cross-entropy where answers about an image weigh 2 and text-only answers 1, over
    the step's target count (the contract's global normaliser)."""
    weight = torch.tensor([2.0 if s.image_grid_thw is not None else 1.0 for s in inputs.samples]
                          + [0.0], dtype=inputs.logits.dtype, device=inputs.targets.device)
    per_position = weight[inputs.sample_ids]  # sample id -1 (padding) picks the trailing 0
    return (inputs.token_loss() * per_position).sum() / inputs.num_targets


def smoothed_loss(inputs, eps=0.1, z=1e-3):
    """Label-smoothed cross-entropy plus a z-loss, from the exact per-token statistics of the
    (vocab-sharded under TP) logits."""
    lse = inputs.logsumexp()
    uniform = lse - inputs.mean_logit()  # cross-entropy against the uniform distribution
    per_position = (1 - eps) * inputs.token_loss() + eps * uniform + z * lse ** 2
    return per_position[inputs.mask].sum() / inputs.num_targets


def user_cross_entropy(inputs):
    """The default loss as a user would write it on the logits (not the engine's function)."""
    return F.cross_entropy(inputs.logits.flatten(0, 1), inputs.targets.flatten(),
                           ignore_index=-100, reduction="sum") / inputs.num_targets


def _layout(vision, text, placement="collocated", text_sp=False):
    (sp, vdp), (tp, tdp) = vision, text
    return dict(placement=placement, vision_dp=vdp, vision_sp=sp, text_dp=tdp, text_tp=tp,
                text_sequence_parallel=text_sp)


def _open_loop_body(rank, world, layout, cfg, steps, loss_fn):
    """The engine trained by forward_backward(loss_fn) + optimizer_step, in fp64."""
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    engine = DHPEngine(demo.tiny_model_config(FAMILY), groups, cfg.step_config(), dtype=torch.float64)
    params0 = engine.named_full_parameters()
    seen = capture_grads(engine)
    history = []
    for mbs in steps:
        out = engine.forward_backward(mbs, loss_fn=loss_fn)
        out.update(engine.optimizer_step())
        history.append(out)
    return {"history": history, "params0": params0, "params": engine.named_full_parameters(),
            "grads": seen}


def _reference(cfg, steps, loss_fn):
    ref = ReferenceTrainer(demo.tiny_model_config(FAMILY), cfg.optim, precision=cfg.precision, dtype=torch.float64)
    params0, grads = ref.named_parameters(), []
    ref.opt.register_step_pre_hook(lambda opt, args, kwargs: grads.append(
        {n: p.grad.detach().clone() for n, p in ref.model.named_parameters()}))
    history = [ref.step(mbs, loss_fn=loss_fn) for mbs in steps]
    return {"history": history, "params": ref.named_parameters(), "params0": params0, "grads": grads}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    return make_steps(tmp_path_factory.mktemp("open_loop"), FAMILY, CFG)


class StepTokenMean:
    """Cross-entropy over a count fixed beforehand (picklable): with it, micro-batches given to
    separate forward_backward calls accumulate the gradient of one step's token mean."""

    def __init__(self, num_targets: int):
        self.num_targets = num_targets

    def __call__(self, inputs):
        return F.cross_entropy(inputs.logits.flatten(0, 1), inputs.targets.flatten(),
                               ignore_index=-100, reduction="sum") / self.num_targets


def _step_vs_open_loop_body(rank, world, layout, cfg, steps):
    """Three engines on the same ranks and data: one trained by step(); one by forward_backward
    with a user-written cross-entropy + optimizer_step; one accumulating one forward_backward
    per micro-batch (normalised by the whole step's count) before optimizer_step."""
    from ray_dhp.step.engine import DHPEngine, count_targets
    from ray_dhp.parallel.mesh import build_groups

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    engines = [DHPEngine(demo.tiny_model_config(FAMILY), groups, cfg.step_config(), dtype=torch.float64)
               for _ in range(3)]
    grads = [capture_grads(e) for e in engines]
    hist = [[], [], []]
    for mbs in steps:
        hist[0].append(engines[0].step(mbs))
        fb = engines[1].forward_backward(mbs, loss_fn=user_cross_entropy)
        hist[1].append({**fb, **engines[1].optimizer_step()})
        loss_fn = StepTokenMean(sum(count_targets(mb) for mb in mbs))
        loss = sum(engines[2].forward_backward([mb], loss_fn=loss_fn)["loss"] for mb in mbs)
        hist[2].append({"loss": loss, **engines[2].optimizer_step()})
    return {"runs": [(h, e.named_full_parameters(), g) for h, e, g in zip(hist, engines, grads)],
            "step_count": [e.step_count for e in engines]}


def test_forward_backward_plus_optimizer_step_is_step(steps):
    """Also with gradient accumulation over several forward_backward calls. 1e-12: the same
    operations in the same order except the loss-value sums and, for accumulation, the order
    in which micro-batch gradients are added (fp64)."""
    layout = _layout((2, 1), (2, 1))
    for out in run_on_ranks(_step_vs_open_loop_body, 2, args=(layout, CFG, steps)):
        assert out["step_count"] == [len(steps)] * 3
        (ha, pa, ga), *others = out["runs"]
        for hb, pb, gb in others:
            for x, y in zip(ha, hb, strict=True):
                keys = set(y) & {"loss", "grad_norm", "lr", "num_targets", "num_samples"}
                assert {"loss", "grad_norm", "lr"} <= keys
                for key in keys:
                    assert abs(x[key] - y[key]) <= 1e-12 * abs(x[key]), (key, x[key], y[key])
            for k in range(len(steps)):  # the clipped gradients each optimizer step received
                assert set(gb[k]) == set(ga[k])
                for name, g in ga[k].items():
                    assert torch.allclose(gb[k][name], g, rtol=1e-12, atol=0), (k, name)
            for name, p in pa.items():
                assert torch.allclose(pb[name], p, rtol=1e-12, atol=0), name


CASES = [
    # (id, layout, loss, packing, default run?)
    ("image-weighted-sp2-tp2", _layout((2, 1), (2, 1)), image_weighted_loss, False, True),
    ("smoothed-sp2-tp2", _layout((2, 1), (2, 1)), smoothed_loss, False, False),  # test_smoothed_loss_is_torchs
    ("image-weighted-sp2dp2-tp2dp2", _layout((2, 2), (2, 2)), image_weighted_loss, False, False),
    ("image-weighted-packed-textsp-tp2", _layout((2, 1), (2, 1), text_sp=True), image_weighted_loss,
     True, False),
    ("image-weighted-disjoint-1-tp2", _layout((1, 1), (2, 1), "disjoint"), image_weighted_loss, False,
     False),
]


@pytest.mark.parametrize("name,layout,loss_fn,packing,default",
                         [pytest.param(*c, marks=() if c[-1] else (pytest.mark.slow,), id=c[0])
                          for c in CASES])
def test_custom_loss_matches_the_reference(steps, name, layout, loss_fn, packing, default):
    cfg = CFG if not packing else TrainLoopConfig(**{**CFG.to_dict(), "max_tokens": 64})
    ref = _reference(CFG, steps, loss_fn)
    default_ref = _reference(CFG, steps[:1], cross_entropy_loss)["history"][0]["loss"]
    # the custom loss is not the default one (by far more than the 1e-10 tolerance): an ignored
    # loss_fn would fail (label smoothing at a near-uniform init moves the loss by ~5e-4)
    assert abs(ref["history"][0]["loss"] - default_ref) > 1e-5 * default_ref
    world = Topology.build(**layout).world_size
    got = merge_ranks(run_on_ranks(_open_loop_body, world, args=(layout, cfg, steps, loss_fn)))
    assert_parity(got, ref, **TOL)


def test_a_loss_fn_must_return_a_scalar(steps):
    from ray_dhp.step.loss import LossInputs, backward_loss

    logits = torch.randn(1, 3, 5, requires_grad=True)
    inputs = LossInputs(logits, torch.tensor([[1, -100, 2]]), torch.zeros(1, 3, dtype=torch.long),
                        [None], 2, 1)
    with pytest.raises(ValueError, match="scalar"):
        backward_loss(lambda x: x.token_loss(), inputs, tensor_parallel=False)
    value = backward_loss(None, inputs, tensor_parallel=False)
    expected = F.cross_entropy(logits[0], torch.tensor([1, -100, 2]), reduction="sum") / 2
    assert abs(float(value) - expected.item()) < 1e-6 and logits.grad is not None


def test_smoothed_loss_is_torchs():
    """On plain logits the smoothing term equals torch's own (which `loss_parallel` cannot run
    on sharded logits: its label smoothing mixes DTensors and plain tensors)."""
    from ray_dhp.step.loss import LossInputs

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    targets = torch.tensor([[1, 2, -100, 4, 5], [-100, 7, 8, 9, -100]])
    inputs = LossInputs(logits, targets, torch.zeros(2, 5, dtype=torch.long), [None, None], 7, 2)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                               reduction="sum", label_smoothing=0.1) / 7
    assert torch.allclose(smoothed_loss(inputs, z=0.0), expected, rtol=1e-12)
    lse = torch.logsumexp(logits, -1)[targets != -100]
    assert torch.allclose(smoothed_loss(inputs) - smoothed_loss(inputs, z=0.0),
                          1e-3 * (lse ** 2).sum() / 7, rtol=1e-10)
