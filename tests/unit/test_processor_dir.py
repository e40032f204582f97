"""A processor saved to a local directory loads back (no torchvision needed) and processes alike."""

from ray_dhp import demo
from ray_dhp.data.processing import as_vl_processor
from ray_dhp.data.reading import read_annotations, resolve_data_root


def test_processor_from_local_dir_matches_the_object(tmp_path):
    proc = demo.tiny_processor()
    proc.tokenizer.save_pretrained(tmp_path / "m")
    proc.image_processor.save_pretrained(tmp_path / "m")
    loaded = as_vl_processor(str(tmp_path / "m"))
    assert loaded.image_processor is not None
    path = demo.make_dataset(tmp_path / "d", num_samples=2)
    rec = read_annotations(path)[0]
    a = proc.process(rec, resolve_data_root(path))
    b = loaded.process(rec, resolve_data_root(path))
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.labels.tolist() == b.labels.tolist()
    assert (a.pixel_values == b.pixel_values).all() and (a.image_grid_thw == b.image_grid_thw).all()
