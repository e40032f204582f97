"""LLaVA-format data pipeline: reading annotations, processing records, collating batches."""

from ray_dhp.data.collate import pack_text_batch, pad_text_batch
from ray_dhp.data.processing import VLProcessor, as_vl_processor
from ray_dhp.data.sample import IGNORE_INDEX, BadSample, Sample, image_grid
from ray_dhp.data.reading import Record, read_annotations, resolve_data_root

__all__ = [
    "IGNORE_INDEX",
    "BadSample",
    "Record",
    "Sample",
    "VLProcessor",
    "as_vl_processor",
    "image_grid",
    "pack_text_batch",
    "pad_text_batch",
    "read_annotations",
    "resolve_data_root",
]
