"""The transformers contract: the seams of transformers' Qwen-VL classes this package relies on,
the lowest release that has all of them, and the checks that fail loudly when they are missing.

Seams (every one present from transformers 5.18.0, checked against that wheel):

* ``forward(..., mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=...)})``
  on every family's ``*ForConditionalGeneration``: the boundary hands the vision features to the
  language model through it. **New in 5.18**: in 5.17 the keyword falls into ``**kwargs`` and is
  ignored, so the logits do not depend on the features (the loss is silently wrong, the feature
  gradient is None and the step fails later in the boundary or waits forever).
* ``mm_token_type_ids`` (M-RoPE positions), ``model.model.get_rope_index`` (packing),
  ``BaseModelOutputWithDeepstackFeatures`` (Qwen3-VL), ``transformers.vision_utils``'s
  ``get_vision_cu_seqlens`` / ``get_vision_position_ids`` / ``get_vision_window_index`` /
  ``get_vision_interpolation_indices_and_weights`` (the Ulysses vision forward),
  ``transformers.utils.generic.is_flash_attention_requested``, ``core_model_loading``'s
  ``WeightConverter`` / ``WeightRenaming`` / ``rename_source_key`` and
  ``conversion_mapping.get_model_conversion_mapping`` (sharded loading), and
  ``Qwen2VLImageProcessorPil`` (processing without torchvision).

`check_signature` runs when an engine or the reference is built (cheap, no forward);
`check_features_consumed` runs after every text backward that was given features, so a
transformers whose forward accepts the keyword but ignores it fails on the first step too.
"""

from __future__ import annotations

import inspect

MIN_TRANSFORMERS = "5.18.0"
SEAM = "mm_encoder_outputs"


class TransformersContractError(RuntimeError):
    """The installed transformers lacks a seam ray_dhp relies on."""


def _message(detail: str) -> str:
    import transformers

    return (f"{detail}: ray_dhp hands the vision features to the language model through "
            f"forward({SEAM}=...), which transformers has from {MIN_TRANSFORMERS}; this is "
            f"transformers {transformers.__version__}. Install transformers>={MIN_TRANSFORMERS} "
            f"(pip install 'transformers>={MIN_TRANSFORMERS},<6').")


def check_signature(model_class) -> None:
    """Raise `TransformersContractError` if ``model_class.forward`` does not name the
    ``mm_encoder_outputs`` parameter (transformers < 5.18 takes it into ``**kwargs``)."""
    params = inspect.signature(model_class.forward).parameters
    if SEAM not in params:
        raise TransformersContractError(_message(
            f"{model_class.__name__}.forward has no {SEAM!r} parameter"))


def check_features_consumed(feats, passed) -> None:
    """After a text backward whose forward was ``passed`` (truthy) features ``feats`` (a leaf that
    requires grad): raise if no gradient reached them, i.e. the forward ignored the seam."""
    if not passed or feats is None or not feats.requires_grad or not feats.is_leaf:
        return
    if feats.grad is None:
        raise TransformersContractError(_message(
            f"the language model's forward ignored {SEAM} (no gradient reached the "
            f"{feats.shape[0]} image-feature rows it was given)"))


def check_transformers(family) -> None:
    """`check_signature` of ``family``'s transformers model class (engine / reference start-up)."""
    import transformers

    check_signature(getattr(transformers, family.model_class))
