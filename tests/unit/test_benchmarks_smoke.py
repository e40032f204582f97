"""Fast checks of the benchmark instruments (no process group, a few seconds): the saved-activation
counter on a toy module, the ViT TP row permutation, and the memory model against the real
parameter counts and the exact activation count of the benchmark ViT."""

import torch

from benchmarks import measure
from benchmarks import memory_model as mm
from benchmarks import shapes
from benchmarks.baselines.vit_tp import qkv_row_permutation


def test_activation_counter_counts_each_saved_storage_once_and_skips_parameters():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    counter = measure.ActivationCounter()
    counter.watch_vision(net[2])  # the last Linear's saved input counts as "vision"
    with counter.count():
        net(x).sum().backward()
    # x (saved by the first Linear) + the ReLU output (saved by ReLU and by the second Linear:
    # one storage, counted once, first seen outside the watched module). Weights are not counted.
    assert counter.as_dict() == {"vision": 0, "text": 8 * 16 * 4 + 8 * 32 * 4, "total": 8 * 16 * 4 + 8 * 32 * 4}


def test_qkv_permutation_gives_each_rank_its_own_heads_of_q_k_v():
    heads, hd, tp = 8, 2, 4
    dim = heads * hd
    perm = qkv_row_permutation(heads, hd, tp)
    rows = torch.arange(3 * dim)[perm].view(tp, 3, heads // tp, hd)  # rank, (q|k|v), local head, hd
    for r in range(tp):
        for which in range(3):
            want = torch.arange(which * dim + r * dim // tp, which * dim + (r + 1) * dim // tp)
            assert torch.equal(rows[r, which].reshape(-1), want)


def test_memory_model_matches_parameters_and_exact_vision_activations():
    from ray_dhp.models import build_model

    config = shapes.model_config("vitheavy")
    model = build_model(config)
    d = mm.Dims.from_config(config)
    assert sum(mm.vision_params(d)) == sum(p.numel() for p in model.model.visual.parameters())
    assert sum(mm.text_params(d)) == sum(p.numel() for n, p in model.named_parameters() if ".visual." not in n)
    sample = shapes.make_sample(0, 64, config)
    counter = measure.ActivationCounter()
    counter.watch_vision(model.model.visual)
    with counter.count():
        model.model.visual(sample.pixel_values, grid_thw=sample.image_grid_thw)
    assert counter.as_dict()["vision"] == 64 * mm.vision_act_elems(d) * 4


def test_memory_model_orders_the_contenders_for_long_images():
    budget = 74 * mm.GiB
    for dims in (mm.QWEN25_VL_7B, mm.QWEN25_VL_32B):
        dhp = mm.max_length(dims, mm.Layout("dhp", 8, sp=8, tp=8), budget, mm.BF16_MIXED, ac=True)
        zero3 = mm.max_length(dims, mm.Layout("zero3", 8), budget, mm.BF16_MIXED, ac=True)
        assert dhp > 2 * zero3 > 0
