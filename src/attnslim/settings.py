"""Settings a recipe carries, validated on construction (`heal`), and the validation helpers shared by the training
configs (`heal`, LISA's `train`, ATP's `recover`): every bad value is an error that names the recipe key, the value
and the valid range. Plain data: nothing here trains."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

from attnslim.data import check_source
from attnslim.errors import AttnslimError

T = TypeVar("T")


def check_ints(section: str, config: Any, lows: dict[str, int]) -> None:
    """Each named field is an int (not a bool) >= its lower bound."""
    for key, lo in lows.items():
        value = getattr(config, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise AttnslimError(f"{section}.{key}={value!r} is invalid; valid: an int >= {lo}")


def check_numbers(section: str, config: Any, keys: tuple[str, ...]) -> None:
    """Each named field is a finite real number (an int or a float, not a bool or a string): checked before the
    range checks compare it, so `lr=abc` or `lr=.inf` is refused when the recipe is read, not mid-training."""
    for key in keys:
        value = getattr(config, key)
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise AttnslimError(f"{section}.{key}={value!r} is invalid; valid: a finite number")


def check_ranges(section: str, config: Any, checks: dict[str, tuple[bool, str]]) -> None:
    """checks: field -> (whether its value is valid, the valid range in words)."""
    for key, (ok, valid) in checks.items():
        if not ok:
            raise AttnslimError(f"{section}.{key}={getattr(config, key)!r} is invalid; valid: {valid}")


def config_from_mapping(cls: type[T], section: str, d: Any) -> T:
    """Build the dataclass `cls` from a recipe section, refusing non-mappings and unknown keys."""
    if not isinstance(d, dict):
        raise AttnslimError(f"{section} must be a mapping of settings, got {type(d).__name__} {d!r}")
    valid = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    if unknown := sorted(set(d) - valid):
        raise AttnslimError(f"{section} has unknown key(s) {unknown}; valid: {sorted(valid)}")
    return cls(**d)


PARAMS = ("changed", "all")
MAX_HEAL_LR = 1.0  # AdamW steps each weight by about lr: at lr > 1 a pretrained model's weights are overwritten
TEACHER_DTYPES = ("float32", "bfloat16")
# the heal's matmul precision: float32, or bfloat16 autocast (float32 weights, optimizer and loss; bfloat16 matmuls),
# or auto: bfloat16 where the device computes it natively (host.native_bf16), else float32 (train/heal.py)
HEAL_PRECISIONS = ("float32", "bfloat16", "auto")


# HealConfig settings added after recipes were fingerprinted
_LATER = ("hidden", "teacher_dtype", "checkpoint", "precision")


@dataclass(frozen=True)
class HealConfig:
    steps: int = 100
    batch_size: int = 4
    seq_len: int = 256
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup: float = 0.05  # fraction of steps
    temperature: float = 1.0
    params: str = "changed"
    source: str = "wiki"
    seed: int = 0
    hidden: float = 0.0  # weight of the hidden-state term (train/heal.py); 0: logits only
    teacher_dtype: str = "float32"  # bfloat16: the teacher held and run in half the memory (train/heal.py)
    checkpoint: bool = False  # gradient checkpointing of the student's decoder layers (train/heal.py)
    precision: str = "float32"  # HEAL_PRECISIONS: bfloat16 autocast of the heal's forward passes (train/heal.py)

    def __post_init__(self) -> None:
        check_source("heal.source", self.source, generated=True)
        check_ints("heal", self, {"steps": 1, "batch_size": 1, "seq_len": 2, "seed": 0})
        check_numbers("heal", self, ("lr", "weight_decay", "warmup", "temperature", "hidden"))
        check_ranges("heal", self, {
            "lr": (0 < self.lr <= MAX_HEAL_LR, f"in (0, {MAX_HEAL_LR:g}]"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "warmup": (0 <= self.warmup < 1, "in [0, 1)"), "temperature": (self.temperature > 0, "> 0"),
            "hidden": (self.hidden >= 0, ">= 0"), "params": (self.params in PARAMS, " | ".join(PARAMS)),
            "teacher_dtype": (self.teacher_dtype in TEACHER_DTYPES, " | ".join(TEACHER_DTYPES)),
            "checkpoint": (isinstance(self.checkpoint, bool), "true | false"),
            "precision": (self.precision in HEAL_PRECISIONS, " | ".join(HEAL_PRECISIONS))})

    @classmethod
    def from_dict(cls, d: Any) -> HealConfig:
        return config_from_mapping(cls, "heal", d)

    def to_dict(self) -> dict[str, Any]:
        """Every setting, except those added after recipes were fingerprinted (_LATER) while at their default:
        a recipe written before them keeps its fingerprint, and stored benchmark rows stay current."""
        default = {f.name: f.default for f in fields(self) if f.name in _LATER}
        return {k: v for k, v in asdict(self).items() if not (k in default and v == default[k])}


@dataclass(frozen=True)
class HeadConfig:
    """The recipe's `head:` section: the LM head (vocab × hidden) factored after every layer step (pipeline/head.py).

    method: the method whose fit is used (methods/head.py's HEAD_FITS: latentllm);  ratio: kept fraction of the
    head's own weights, in (0, 1];  untie: a head tied to the token embedding is refused unless true (the embedding
    stays dense, the head becomes B·A: the model gains the head's kept weights);  args: the method's fit settings
    (latentllm: precond, junction, damp, alpha), checked by the method when the recipe is checked."""

    method: str = "latentllm"
    ratio: float = 0.8
    untie: bool = False
    args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_numbers("head", self, ("ratio",))
        check_ranges("head", self, {
            "method": (isinstance(self.method, str) and bool(self.method), "a method name, e.g. latentllm"),
            "ratio": (0 < self.ratio <= 1, "in (0, 1]: the kept fraction of the head's weights"),
            "untie": (isinstance(self.untie, bool), "true | false"),
            "args": (self.args is None or isinstance(self.args, dict), "a mapping of the method's fit settings")})

    @classmethod
    def from_dict(cls, d: Any) -> HeadConfig:
        return config_from_mapping(cls, "head", d)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "ratio": self.ratio, "untie": self.untie, "args": dict(self.args or {})}
