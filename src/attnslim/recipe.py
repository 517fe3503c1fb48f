"""Recipes: calibration data plus ordered steps (one method on a layer selector each); YAML I/O; pure.

YAML is read with a loader that keeps "4:28" a string (YAML 1.1 would read it as the base-60 int 268).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from attnslim.data.sources import check_source
from attnslim.errors import AttnslimError, first_line
from attnslim.settings import HeadConfig, HealConfig

RECIPES_DIR = Path(__file__).parent / "recipes"  # package data; the checkout's recipes/ links here
SELECTOR_FORMS = ('"all", "A:B" (python slice, negatives allowed: "4:28", "-6:"), an int, a list of ints, '
                  'or "rest" (last step only: every layer the earlier steps did not convert)')
REST = "rest"
LayerSelector = str | int | tuple[int, ...]
_SLICE = re.compile(r"^\s*(-?\d+)?\s*:\s*(-?\d+)?\s*$")


class _Loader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1 sexagesimal ints, so `layers: 4:28` stays the string "4:28", and with
    exponent floats without a dot (1e-3)."""

    yaml_implicit_resolvers = {
        ch: [(tag, rx) for tag, rx in rs if tag != "tag:yaml.org,2002:int"]
        for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def compose_node(self, parent: Any, index: Any) -> Any:
        """Refuse aliases: a few hundred bytes of nested aliases expand to gigabytes (a "billion laughs")."""
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "YAML aliases (*name) are not allowed in recipes; "
                                              "write the value out", self.peek_event().start_mark)
        return super().compose_node(parent, index)


_INT = r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(_INT), list("-+0123456789"))
# YAML 1.2 floats as users write them: 1e-3 and 1.0e3 (YAML 1.1 reads both as strings)
_FLOAT = r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*|[0-9][0-9_]*(?=[eE]))(?:[eE][-+]?[0-9]+)?$"
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_FLOAT), list("-+0123456789."))


def _check_int(where: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise AttnslimError(f"{where} must be an int, got {type(value).__name__} {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise AttnslimError(f"{where} must be {rng}, got {value}")


@dataclass(frozen=True)
class Calibration:
    """Calibration data: `windows` token windows of `seq_len` tokens from `source`, shuffled by `seed`."""

    source: str = "wiki"
    windows: int = 32
    seq_len: int = 512
    seed: int = 0
    batch_size: int = 4

    def __post_init__(self) -> None:
        check_source("calibration.source", self.source, generated=True)
        _check_int("calibration.windows", self.windows, 1)
        _check_int("calibration.seq_len", self.seq_len, 2, 32768)
        _check_int("calibration.seed", self.seed)
        _check_int("calibration.batch_size", self.batch_size, 1)


def _check_selector(where: str, sel: object) -> LayerSelector:
    if (isinstance(sel, int) and not isinstance(sel, bool)) or (isinstance(sel, str) and _SLICE.match(sel)):
        return sel
    if sel in ("all", REST):
        return str(sel)
    if isinstance(sel, list | tuple) and all(isinstance(i, int) and not isinstance(i, bool) for i in sel):
        return tuple(sel)
    hint = ' (quote slices in YAML: layers: "-6:")' if isinstance(sel, dict) else ""
    raise AttnslimError(f"{where} = {sel!r} is not a layer selector; valid forms: {SELECTOR_FORMS}{hint}")


def selector_from_text(text: str) -> LayerSelector:
    """A layer selector typed on a command line: "all", a slice "4:28", an index "5" or indices "5,11,17"."""
    if re.fullmatch(r"-?\d+(,-?\d+)*", text.strip()):
        ints = [int(i) for i in text.split(",")]
        return ints[0] if len(ints) == 1 else tuple(ints)
    return _check_selector("--layers", text)


@dataclass(frozen=True)
class Step:
    """One method applied to a set of layers with its hyperparameters (`args`, validated by the method)."""

    method: str
    layers: str | int | Sequence[int] = "all"
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise AttnslimError(f"method must be a non-empty str (method name), got {self.method!r}")
        object.__setattr__(self, "layers", _check_selector("layers", self.layers))
        try:  # a JSON round trip copies args and keeps them plain data for compression.json and fingerprints
            if not isinstance(self.args, dict):
                raise TypeError(f"got {type(self.args).__name__}, expected a mapping of hyperparameters")
            object.__setattr__(self, "args", json.loads(json.dumps(self.args)))
        except (TypeError, ValueError) as e:
            raise AttnslimError(f"args of {self.method!r} must be str/number/bool/list/dict data: {e}") from e


def resolve_layers(selector: str | int | Sequence[int], n_layers: int) -> list[int]:
    """Sorted unique layer indices that `selector` picks among `n_layers` layers; errors if out of range."""
    _check_int("n_layers", n_layers, 1)

    def bad(why: str) -> AttnslimError:
        return AttnslimError(f"layer selector {selector!r} {why} for a model with n_layers={n_layers}; valid "
                             f"forms: {SELECTOR_FORMS}, indices in [-{n_layers}, {n_layers - 1}]")

    sel = _check_selector("layer selector", selector)
    if sel == REST:
        raise AttnslimError(f'layer selector "{REST}" depends on what earlier steps converted; it is resolved by '
                            "api.compress, not by resolve_layers")
    if sel == "all":
        return list(range(n_layers))
    if isinstance(sel, str):
        ends = [int(g) if g is not None else None for g in _SLICE.match(sel).groups()]  # type: ignore[union-attr]
        if any(e is not None and not -n_layers <= e <= n_layers for e in ends):
            raise bad("is out of range")
        out = list(range(n_layers))[slice(*ends)]
    else:
        idx = [sel] if isinstance(sel, int) else list(sel)
        if any(not -n_layers <= i < n_layers for i in idx):
            raise bad("is out of range")
        out = sorted({i % n_layers for i in idx})
    if not out:
        raise bad("selects no layers")
    return out


@dataclass(frozen=True)
class Recipe:
    """A named, ordered list of steps with the calibration data they share."""

    name: str
    calibration: Calibration = field(default_factory=Calibration)
    steps: tuple[Step, ...] = ()
    description: str = ""
    heal: dict[str, Any] | None = None  # settings of settings.HealConfig: distil the result after the steps
    head: dict[str, Any] | None = None  # settings of settings.HeadConfig: factor the LM head after the steps

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise AttnslimError(f"name must be a non-empty str, got {type(self.name).__name__} {self.name!r}")
        if not isinstance(self.calibration, Calibration):
            fix = ("Calibration(**calibration)" if isinstance(self.calibration, Mapping) else
                   "Calibration(source=..., windows=..., seq_len=...)")
            raise TypeError(f"Recipe calibration must be an attnslim.Calibration, got "
                            f"{type(self.calibration).__name__} {self.calibration!r}; pass {fix}")
        if self.heal is not None:
            object.__setattr__(self, "heal", HealConfig.from_dict(self.heal).to_dict())
        if self.head is not None:
            object.__setattr__(self, "head", HeadConfig.from_dict(self.head).to_dict())
        if not isinstance(self.description, str):
            raise AttnslimError(f"description must be a str, got {type(self.description).__name__}")
        if isinstance(self.steps, str | Mapping) or not isinstance(self.steps, Sequence):
            raise TypeError(f"Recipe steps must be a list of attnslim.Step, got {type(self.steps).__name__} "
                            f"{self.steps!r}; e.g. steps=[Step('svd', 'all', {{'ratio': 0.5}})], or load a packaged "
                            "recipe with attnslim.load_recipe('svd')")
        object.__setattr__(self, "steps", tuple(self.steps))
        for i, step in enumerate(self.steps):
            if not isinstance(step, Step):
                fix = "Step(**step)" if isinstance(step, Mapping) else "Step(method, layers, args)"
                raise TypeError(f"Recipe steps[{i}] must be an attnslim.Step, got {type(step).__name__} {step!r}; "
                                f"pass {fix}, or build the recipe from plain data with recipe_from_dict")
        if not self.steps:
            raise AttnslimError(f"recipe {self.name!r} has no steps; add at least one under 'steps:'")

    def resolve(self, n_layers: int, methods: Mapping[str, type]) -> list[tuple[Step, list[int] | None]]:
        """Each step with its concrete candidate layers (None for a final "rest" step: known only after the
        earlier steps ran, see `rest_layers`); errors on unknown methods and on layers claimed twice."""
        out: list[tuple[Step, list[int] | None]] = []
        for i, step in enumerate(self.steps):
            if step.method not in methods:
                raise AttnslimError(f"recipe {self.name!r} step {i} uses unknown method {step.method!r}; "
                                    f"valid methods: {', '.join(sorted(methods)) or '(none)'}")
            if step.layers == REST:
                if i == 0 or i != len(self.steps) - 1:
                    raise AttnslimError(f'recipe {self.name!r} step {i} ({step.method}): layers "{REST}" is only '
                                        "valid for the last step of a recipe with several steps")
                out.append((step, None))
                continue
            layers = resolve_layers(step.layers, n_layers)
            for j, (prev, prev_layers) in enumerate(out):
                if shared := sorted(set(prev_layers or ()) & set(layers)):
                    a, b = f"{prev.method}, layers {prev.layers!r}", f"{step.method}, layers {step.layers!r}"
                    raise AttnslimError(f"recipe {self.name!r}: step {j} ({a}) and step {i} ({b}) both claim "
                                        f"layers {shared}; give each step disjoint layers")
            out.append((step, layers))
        return out


def rest_layers(n_layers: int, converted: set[int]) -> list[int]:
    """The layers of a "rest" step: those no earlier step converted; an error when none is left."""
    out = [i for i in range(n_layers) if i not in converted]
    if not out:
        raise AttnslimError(f'layers "{REST}": the earlier steps converted all {n_layers} layers; drop the last step')
    return out


def _keys(where: str, d: object, valid: Sequence[str], required: Sequence[str] = ()) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise AttnslimError(f"{where} must be a mapping, got {type(d).__name__} {d!r:.80}")
    if unknown := sorted(str(k) for k in d if k not in valid):
        raise AttnslimError(f"{where} has unknown key(s) {unknown}; valid keys: {', '.join(valid)}")
    if missing := [k for k in required if k not in d]:
        raise AttnslimError(f"{where} is missing required key(s) {missing}")
    return d


def recipe_from_dict(d: Mapping[str, Any]) -> Recipe:
    """Build and validate a Recipe from plain data (as read from YAML)."""
    d = _keys("recipe", d, ("name", "description", "calibration", "steps", "heal", "head"), ("name", "steps"))
    cal = _keys("calibration", d.get("calibration") or {}, tuple(f.name for f in fields(Calibration)))
    if not isinstance(d["steps"], list):
        raise AttnslimError(f"steps must be a list of steps, got {type(d['steps']).__name__} {d['steps']!r}")
    steps = []
    for i, s in enumerate(d["steps"]):
        s = _keys(f"steps[{i}]", s, ("method", "layers", "args"), ("method",))
        try:
            steps.append(Step(s["method"], s.get("layers", "all"), s.get("args") or {}))
        except AttnslimError as e:
            raise AttnslimError(f"steps[{i}]: {e}") from e
    return Recipe(d["name"], Calibration(**cal), tuple(steps), d.get("description") or "", d.get("heal"),
                  d.get("head"))


def recipe_to_dict(r: Recipe) -> dict[str, Any]:
    """Plain data (JSON/YAML-ready) that `recipe_from_dict` turns back into an equal Recipe."""
    steps = [{"method": s.method, "layers": list(s.layers) if isinstance(s.layers, tuple) else s.layers,
              "args": json.loads(json.dumps(s.args))} for s in r.steps]
    cal = {f.name: getattr(r.calibration, f.name) for f in fields(Calibration)}
    out = {"name": r.name, "description": r.description, "calibration": cal, "steps": steps}
    out |= {} if r.heal is None else {"heal": dict(r.heal)}  # absent when unset: fingerprints unchanged
    return out if r.head is None else {**out, "head": json.loads(json.dumps(r.head))}


def load_recipe(path_or_name: str | Path) -> Recipe:
    """A recipe from a YAML path or a packaged name ("default" -> recipes/default.yaml)."""
    s = str(path_or_name)
    is_path = isinstance(path_or_name, Path) or s.endswith((".yaml", ".yml")) or "/" in s or "\\" in s
    path = Path(s).expanduser() if is_path else RECIPES_DIR / f"{s}.yaml"
    if path.is_dir():
        raise AttnslimError(f"recipe {s!r} is a directory; give the path of a YAML file")
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
        raise AttnslimError(f"recipe {s!r} not found ({path}); give a YAML path or a packaged name: {names}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
        if not isinstance(data, Mapping):  # its contents are not echoed: the file may be anything (/etc/passwd)
            raise AttnslimError(f"not a recipe: its YAML is a {type(data).__name__}, not a mapping with name: and "
                                "steps: (see the packaged recipes, e.g. attnslim's recipes/svd.yaml)")
        return recipe_from_dict(data)
    except UnicodeDecodeError as e:
        raise AttnslimError(f"recipe file {path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                            "UTF-8") from None
    except yaml.YAMLError as e:
        raise AttnslimError(f"recipe file {path} is not valid YAML (quote slices like \"-6:\"): {e}") from e
    except AttnslimError as e:
        raise AttnslimError(f"{path}: {e}") from e


def dump_recipe(r: Recipe, path: str | Path) -> None:
    """Write `r` as YAML that `load_recipe` reads back into an equal Recipe."""
    text = yaml.safe_dump(recipe_to_dict(r), sort_keys=False, default_flow_style=None, width=110)
    Path(path).write_text(text, encoding="utf-8")


def yaml_value(raw: str, where: str) -> Any:
    """A command-line value parsed as YAML (1e-3 is a float, [1, 2] a list); a clear error if it does not parse."""
    try:
        return yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as err:
        problem = first_line(err, 10_000)
        raise AttnslimError(f"{where}: the value {raw!r} is not valid YAML ({problem}); quote strings, write "
                            "lists as [1, 2]") from None


def apply_overrides(recipe: Recipe, overrides: Sequence[str]) -> Recipe:
    """Apply CLI `--set key=value` overrides (e.g. `steps.0.args.ratio=0.5`); values are parsed as YAML."""
    d: Any = recipe_to_dict(recipe)
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise AttnslimError(f"override {item!r} must look like key=value, e.g. calibration.windows=64")
        parts = key.split(".")
        is_slice = parts[-1] == "layers" and _SLICE.match(raw)
        value = raw.strip() if is_slice else yaml_value(raw, f"--set {item}")
        if parts[0] == "heal" and d.get("heal") is None:
            d["heal"] = {}  # `--set heal.steps=200` or `--set heal={}` turns healing on (HealConfig validates)
        if parts[0] == "head" and d.get("head") is None:
            d["head"] = HeadConfig().to_dict()  # `--set head.untie=true` turns the head step on, at its defaults
        node = d
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            if isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
                idx: Any = int(part)
            elif isinstance(node, dict) and (part in node or (last and depth > 0
                                                              and parts[depth - 1] in ("args", "heal", "head"))):
                idx = part  # a new key is allowed only directly under args, heal or head (validated there)
            else:
                valid = (f"indices 0..{len(node) - 1}" if isinstance(node, list) else ", ".join(node)
                         if isinstance(node, dict) else "nothing, it is a value")
                raise AttnslimError(f"override path {key!r}: no {part!r} under "
                                    f"{'.'.join(parts[:depth]) or 'the top level'}; valid: {valid}")
            if last:
                node[idx] = value
            node = node[idx]
    return recipe_from_dict(d)


def fingerprint(recipe: Recipe) -> str:
    """First 16 hex chars of the sha256 of the recipe's canonical JSON (`digest`)."""
    return digest(recipe_to_dict(recipe))


def digest(data: Mapping[str, Any]) -> str:
    """First 16 hex chars of the sha256 of data's canonical JSON (sorted keys, no spaces)."""
    canon = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]
