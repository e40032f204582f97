"""Per-module training choices, parsed: which of the vision tower, the merger, an encoder such as
Qwen2.5-Omni's audio tower and the language model train,
with which learning rate and weight decay (``train_loop_config["modules"]``, run file
``optim.modules``)::

    modules:
      vision: {train: false}                   # frozen vision tower
      merger: {lr: 1.0e-4, weight_decay: 0.0}  # its own lr / decay
      llm: {lora: {r: 8, alpha: 16}}           # PEFT LoRA adapters, base weights frozen

A module not named trains with ``lr`` / ``weight_decay``. Parameters are assigned to a module by
their name in the transformers model: ``model.visual.merger.*`` and Qwen3-VL's
``model.visual.deepstack_merger_list.*`` are the merger, the rest of ``model.visual.*`` the
vision tower, ``model.audio_tower.*`` the audio encoder (`FamilySpec.encoders`), everything else
(``model.language_model.*``, ``lm_head.*``) the language model.

Which parameter belongs to which module, and freezing them: `ray_dhp.models.tuning`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable, Optional

from ray_dhp.config.checks import ConfigError

MODULES = ("vision", "merger", "audio", "llm")
CORE_MODULES = ("vision", "merger", "llm")  # the modules of every family
MODULE_KEYS = ("train", "lr", "weight_decay", "lora")
LORA_KEYS = ("r", "alpha", "target_modules")
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Mixture-of-experts parts that are not LoRA targets (they stay frozen under LoRA), and why.
MOE_PARTS = {
    "experts": "the fused experts are 3-D parameters (mlp.experts.gate_up_proj [E, 2I, H], "
               "down_proj [E, H, I]), not nn.Linear layers an adapter can wrap",
    "gate_up_proj": "a fused expert parameter, not an nn.Linear",
    "gate": "the router (mlp.gate) stays frozen under LoRA",
    "shared_expert_gate": "the shared expert's gate (Linear(H, 1)) stays frozen under LoRA",
}


@dataclass(frozen=True)
class LoraChoice:
    """PEFT LoRA adapters on the language model's linears named in ``target_modules``."""

    r: int = 8
    alpha: float = 16.0
    target_modules: tuple = DEFAULT_LORA_TARGETS


@dataclass(frozen=True)
class ModuleChoice:
    train: bool = True
    lr: Optional[float] = None            # None: the run's lr
    weight_decay: Optional[float] = None  # None: the run's weight_decay


@dataclass(frozen=True)
class Tuning:
    """The parsed ``modules`` setting (see the module docstring)."""

    modules: dict = field(default_factory=dict)  # name -> ModuleChoice (every module)
    lora: Optional[LoraChoice] = None

    def choice(self, module: str) -> ModuleChoice:
        return self.modules.get(module, ModuleChoice())
    @property
    def default(self) -> bool:
        return self.lora is None and all(c == ModuleChoice() for c in self.modules.values())


# -- parsing ---------------------------------------------------------------------------------

def parse_tuning(spec: Optional[dict], key: str = "train_loop_config.modules") -> Tuning:
    """The `Tuning` of a ``modules`` mapping, or ConfigError naming the dotted key at fault."""
    if spec is None:
        return Tuning()
    if not isinstance(spec, dict):
        raise ConfigError(f"{key}: expected a mapping {{vision|merger|audio|llm: {{train, lr, "
                          f"weight_decay, lora}}}}, got {spec!r}.")
    modules, lora = {}, None
    for module, sub in spec.items():
        where = f"{key}.{module}"
        if module not in MODULES:
            raise ConfigError(f"{where}: unknown module{_hint(module, MODULES)}")
        sub = {} if sub is None else sub
        if not isinstance(sub, dict):
            raise ConfigError(f"{where}: expected a mapping of {list(MODULE_KEYS)}, got {sub!r}.")
        for k in sub:
            if k not in MODULE_KEYS:
                raise ConfigError(f"{where}.{k}: unknown key{_hint(k, MODULE_KEYS)}")
        modules[module] = ModuleChoice(train=_bool(sub.get("train", True), f"{where}.train"),
                                       lr=_number(sub.get("lr"), f"{where}.lr", positive=True),
                                       weight_decay=_number(sub.get("weight_decay"),
                                                            f"{where}.weight_decay"))
        if sub.get("lora") is not None:
            if module != "llm":
                raise ConfigError(f"{where}.lora: LoRA adapters go on the language model only "
                                  f"(set {key}.llm.lora).")
            if not modules[module].train:
                raise ConfigError(f"{where}.lora contradicts {where}.train=false: LoRA trains "
                                  f"adapters on the language model; drop one of them.")
            lora = _parse_lora(sub["lora"], f"{where}.lora")
    tuning = Tuning({m: modules.get(m, ModuleChoice()) for m in MODULES}, lora)
    # every model has the vision side and the LM; an encoder such as audio only some do, so it
    # counts as training only where the mapping names it
    if not any(c.train for m, c in tuning.modules.items() if m in CORE_MODULES or m in modules):
        raise ConfigError(f"{key}: every module is frozen (train=false for vision, merger and "
                          f"llm): nothing would train.")
    return tuning


def parse_tuning_named(spec: Optional[dict], name: Callable[[str], str]) -> Tuning:
    """`parse_tuning` whose errors keep a template (``{modules}``), so that the run file can
    rename the key (``optim.modules...``) like every other configuration error."""
    mark = "\x00"
    try:
        return parse_tuning(spec, key=mark)
    except ConfigError as e:
        template = str(e).replace("{", "{{").replace("}", "}}").replace(mark, "{modules}")
        raise ConfigError.about(template, name) from None


def _parse_lora(spec, where: str) -> LoraChoice:
    if spec is True:
        spec = {}
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: expected a mapping of {list(LORA_KEYS)} (or true), got {spec!r}.")
    for k in spec:
        if k not in LORA_KEYS:
            raise ConfigError(f"{where}.{k}: unknown key{_hint(k, LORA_KEYS)}")
    r = spec.get("r", LoraChoice.r)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"{where}.r: the adapter rank must be an integer >= 1, got {r!r}.")
    alpha = _number(spec.get("alpha", LoraChoice.alpha), f"{where}.alpha", positive=True)
    targets = spec.get("target_modules", DEFAULT_LORA_TARGETS)
    if isinstance(targets, str):
        targets = (targets,)
    moe = [t for t in targets if t in MOE_PARTS]
    if moe:
        raise ConfigError(f"{where}.target_modules: {moe}: {'; '.join(MOE_PARTS[t] for t in moe)}; "
                          f"LoRA takes the linears {list(DEFAULT_LORA_TARGETS)} (on a "
                          "mixture-of-experts model: attention, dense and shared-expert MLPs).")
    bad = [t for t in targets if t not in DEFAULT_LORA_TARGETS]
    if not targets or bad:
        raise ConfigError(f"{where}.target_modules: {bad or 'empty'}: choose among the language "
                          f"model's linears {list(DEFAULT_LORA_TARGETS)}.")
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"{where}: LoRA uses PEFT, which is not installed: "
                          f"pip install 'ray_dhp[lora]' (or pip install peft).")
    return LoraChoice(r=r, alpha=alpha, target_modules=tuple(targets))


def _hint(word: str, known) -> str:
    close = difflib.get_close_matches(str(word), known, n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {list(known)}."


def _bool(v, where: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: expected true or false, got {v!r}.")
    return v


def _number(v, where: str, positive: bool = False) -> Optional[float]:
    import math

    if v is None:
        return None
    try:
        x = float(v) if not isinstance(v, bool) else None
    except (TypeError, ValueError):
        x = None
    if x is None or not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise ConfigError(f"{where}: expected a finite number {'> 0' if positive else '>= 0'}, "
                          f"got {v!r}.")
    return x


def tuning_of(cfg) -> Tuning:
    """The `Tuning` of the run's ``optim`` section (`ray_dhp.config.sections.OptimConfig`, or
    anything with a ``modules`` attribute)."""
    return parse_tuning(cfg.modules)



def check_layout(tuning: Tuning, text_sequence_parallel: bool,
                 key: str = "train_loop_config.modules") -> None:
    """ConfigError for choices the layout cannot take: LoRA with text sequence parallelism
    (its row-parallel layers reduce-scatter into a sequence shard; the adapters' plan covers
    the plain TP plan only)."""
    if tuning.lora is not None and text_sequence_parallel:
        raise ConfigError(f"{key}.llm.lora: LoRA adapters are not covered with text sequence "
                          f"parallelism (text.sequence_parallel=true); turn one of them off.")


def same_structure(saved: Optional[dict], current: Optional[dict]) -> str:
    """Why a checkpoint saved under the ``modules`` choice ``saved`` cannot resume under
    ``current`` ("" if it can): which modules train and the LoRA adapters decide which
    parameters, optimizer states and masters exist; learning rates and weight decay may differ."""
    a, b = parse_tuning(saved), parse_tuning(current)
    if a.lora != b.lora:
        return "the LoRA adapters differ"
    changed = [m for m in MODULES if a.choice(m).train != b.choice(m).train]
    return f"{', '.join(changed)} train(s) in one and not the other" if changed else ""
