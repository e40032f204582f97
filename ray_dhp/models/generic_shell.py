"""The vision side of a generic family (`ray_dhp.models.generic`) as a *shell* of the model's own
inner class: `ShellEncoder`.

The shell holds only the vision parts of ``model.model`` (the same objects, under the same
names), so the model's own ``get_image_features`` runs on it unchanged. A part is a child module
(``vision_tower``, ``multi_modal_projector``) or a parameter the inner model holds itself
(LLaVA-NeXT's and -OneVision's ``image_newline``, the row ``get_image_features`` appends after
each row of an image's tiles): the shell registers it as its own parameter. A rank builds the
shell once per model (`ShellEncoder.module` keeps it on the owner), and `part_modules` names the
shell itself where it holds parameters, so materialising the rank's parts gives the shell the
real tensors (`ray_dhp.models.loading.materialize` replaces a parameter where its holders keep
it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ray_dhp.models.base import EncoderSpec

__all__ = ["ShellEncoder"]

_CACHE = "_ray_dhp_shell"  # the owner's plain attribute holding its shell (not a module)


@dataclass(frozen=True)
class ShellEncoder(EncoderSpec):
    """An encoder whose module is a *shell* of ``model.model``'s own class holding only the
    encoder's parts (the same module objects and parameters, names ``<part>.<name>`` or
    ``<part>``), so the model's own ``get_image_features`` runs on it unchanged."""

    root: str = "model"  # where the parts live: ``model.model``, or "" (the model's top)

    def _owner(self, model) -> torch.nn.Module:
        return model.get_submodule(self.root) if self.root else model

    def module(self, model) -> torch.nn.Module:
        inner = self._owner(model)
        cached = inner.__dict__.get(_CACHE)
        if cached is not None:
            return cached
        shell = type(inner).__new__(type(inner))
        torch.nn.Module.__init__(shell)
        shell.__dict__.update({k: v for k, v in vars(inner).items()  # plain attributes the
                               if not k.startswith("_") and not isinstance(v, torch.nn.Module)})
        shell.config = inner.config  # code reads (Ovis2's visual_vocab_size), no modules
        for p in self.parts:
            part = getattr(inner, p)
            if isinstance(part, torch.nn.Parameter):
                shell.register_parameter(p, part)
            else:
                shell.add_module(p, part)
        inner.__dict__[_CACHE] = shell
        return shell

    @property
    def prefix(self) -> str:
        return f"{self.root}." if self.root else ""

    def part_modules(self, model) -> dict:
        inner = self._owner(model)
        if any(isinstance(getattr(inner, p), torch.nn.Parameter) for p in self.parts):
            return {self.prefix: self.module(model)}  # its own parameters and the child parts
        return {f"{self.prefix}{p}.": getattr(inner, p) for p in self.parts}
