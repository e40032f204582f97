"""`StepLoader` in one process: the prefetching thread hands out the sampler's steps in order,
checkpoints store the position of the last step handed out (not the prefetched one), and errors
raised in the thread reach the training thread."""

import pytest

from ray_dhp import demo
from ray_dhp.data.loader import StepLoader
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.config.train_loop import TrainLoopConfig


def _sampler(path, **cfg):
    return StepSampler(read_annotations(path), demo.tiny_processor(), resolve_data_root(path),
                       TrainLoopConfig(**cfg).sampler_config())


def _ids(micro_batches):
    return [[s.index for s in mb] for mb in micro_batches]


@pytest.mark.parametrize("workers", [0, 1])
def test_prefetch_hands_out_the_sampler_steps_and_checkpoints_the_consumed_position(tmp_path, workers):
    path = demo.make_dataset(tmp_path / "d", num_samples=12, bad_lines=[(3, "missing_image")])
    ref = _sampler(path, global_batch_size=4, micro_batches=2)
    want, states = [], []
    for _ in range(4):
        want.append(_ids(ref.next_step()))
        states.append((ref.state_dict(), ref.skipped, ref.epoch))
    loader = StepLoader(_sampler(path, global_batch_size=4, micro_batches=2), prefetch=True,
                        num_workers=workers)
    loader.start(4)
    for k in range(4):
        got = loader.next()
        assert _ids(got) == want[k]
        assert all(s.pixel_values is not None for mb in got for s in mb if s.image_grid_thw is not None)
        # the thread may already be a step ahead; the checkpointed position is the consumed one
        assert (loader.state_dict(), loader.skipped, loader.epoch) == states[k]
    # resume from the state after step 2: the same steps 3 and 4
    resumed = StepLoader(_sampler(path, global_batch_size=4, micro_batches=2), prefetch=True)
    resumed.load_state_dict(states[1][0])
    resumed.start(2)
    assert [_ids(resumed.next()) for _ in range(2)] == want[2:]
    loader.close()


def test_strict_error_in_the_prefetch_thread_reaches_the_caller(tmp_path):
    path = demo.make_dataset(tmp_path / "d", num_samples=8, bad_lines=[(6, "corrupt_image")])
    loader = StepLoader(_sampler(path, global_batch_size=8, bad_data="strict"), prefetch=True,
                        num_workers=1)
    loader.start(2)
    with pytest.raises(ValueError, match=r"data\.jsonl:7: .*corrupt image"):
        loader.next()
    loader.close()
