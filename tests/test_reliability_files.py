"""Regression tests of ../shared/reviews/reliability.md round 3 (issue 43), the model-directory part: each test is
named after the probe's case id. Nothing is written through a link, no file that is not a regular file is read,
integrity checks cannot be skipped, interrupted swaps are named on read, sizes are bounded by the weights before a
model is built, and damaged JSON is a clear error. Tiny models; stand-in files in tmp_path, never a real rc file."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import attnslim
from attnslim import outdir
from attnslim.api import compress, compress_offloaded
from attnslim.errors import AttnslimError
from attnslim.io import load, save
from attnslim.report.page import write_report
from conftest import TINY_BUILDERS, tiny_llama
from helpers import ByteTokenizer, SavingTokenizer, one_step

SRC = Path(attnslim.__file__).resolve().parents[1]  # the attnslim under test, also in child processes


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Integrity stamps go to the user's cache: a fresh one per test."""
    monkeypatch.setenv("ATTNSLIM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNSLIM_VERIFY", raising=False)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A compressed (format 2) directory, a sharded (format 3) one and a Hugging Face one, built once."""
    root = tmp_path_factory.mktemp("bases")
    model = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = compress(model, ByteTokenizer(), one_step("svd", {"ratio": 0.5}, layers="0:2"), progress=False)
    save(model, SavingTokenizer(), root / "svd", report.to_json())
    hf = root / "hf"
    TINY_BUILDERS["llama"]().save_pretrained(hf)
    SavingTokenizer().save_pretrained(hf)
    compress_offloaded(hf, one_step("svd", {"ratio": 0.5}), root / "off", tokenizer=SavingTokenizer(), progress=False)
    return root


def _copy(bases: Path, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(bases / name, tmp_path / name))


def _edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def _in_subprocess(code: str, timeout: int = 60) -> subprocess.CompletedProcess[str]:
    """Run `code` in a child with 2 GB of address space and a timeout: what used to hang or fill memory."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              preexec_fn=limit, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s (hangs)")


def _refused_quickly(call: str, directory: Path, message: str) -> None:
    proc = _in_subprocess(f"import sys\nfrom attnslim.errors import AttnslimError\n{call}\n"
                          f"try:\n    run({str(directory)!r})\nexcept AttnslimError as e:\n    print(e); sys.exit(2)")
    assert proc.returncode == 2 and message in proc.stdout, proc.stdout + proc.stderr[-2000:]


# ---------------------------------------------------------------- F1, F2: no write through a link

def test_s06_report_refuses_symlink(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("my data")
    (d / "report.html").symlink_to(victim)
    with pytest.raises(AttnslimError, match="report.html is a symbolic link"):
        write_report(d)
    assert victim.read_text() == "my data"


def test_s07_report_md_link_to_an_rc_file_is_never_written(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    _edit_json(d / "compression.json", lambda v: v.update(base_model="$(touch PWNED;"))
    rc = tmp_path / "fake_rc"
    rc.write_text("# my shell rc\n")
    (d / "report.md").symlink_to(rc)
    with pytest.raises(AttnslimError, match="report.md is a symbolic link"):
        write_report(d)
    assert rc.read_text() == "# my shell rc\n" and not (d / "report.html").exists(), "neither file is written"


def test_s08_loading_a_sharded_output_writes_nothing_into_it(bases, tmp_path):
    d = _copy(bases, "off", tmp_path)
    victim = tmp_path / "victim3.txt"
    victim.write_text("mine")
    (d / ".attnslim-verified.json").symlink_to(victim)
    before = sorted(p.name for p in d.iterdir())
    load(d)
    assert victim.read_text() == "mine" and sorted(p.name for p in d.iterdir()) == before
    assert list((tmp_path / "cache" / "verified").iterdir()), "the stamps went to the user's cache"


def test_s09_shard_named_after_a_command_is_refused(bases, tmp_path):
    d = _copy(bases, "off", tmp_path)
    evil = "$(touch PWNED_stamp)"
    shutil.copy(d / "model-00001-of-00005.safetensors", d / evil)
    first = "model-00001-of-00005.safetensors"
    _edit_json(d / "compression.json", lambda v: v["weights_shards"].update({evil: dict(v["weights_shards"][first])}))
    with pytest.raises(AttnslimError, match="must be named model-00001-of-N"):
        load(d)


def _move_shard_key(d: Path, new_key: str) -> None:
    def edit(v):
        v["weights_shards"][new_key] = v["weights_shards"].pop("model-00002-of-00005.safetensors")
    _edit_json(d / "compression.json", edit)


def test_j17_absolute_shard_key_is_refused(bases, tmp_path):
    d = _copy(bases, "off", tmp_path)
    _move_shard_key(d, str(bases / "off" / "model-00002-of-00005.safetensors"))
    (d / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(AttnslimError, match="must be named model-00001-of-N"):
        load(d)


def test_j18_dotdot_shard_key_is_refused(bases, tmp_path):
    d = _copy(bases, "off", tmp_path)
    _move_shard_key(d, "../off-src/model-00002-of-00005.safetensors")
    shutil.copytree(bases / "off", tmp_path / "off-src")
    (d / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(AttnslimError, match="must be named model-00001-of-N"):
        load(d)


def test_j18_shard_link_leading_out_of_the_directory_is_refused(bases, tmp_path):
    d = _copy(bases, "off", tmp_path)
    shard = d / "model-00002-of-00005.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(AttnslimError, match="outside the directory"):
        load(d)


# ---------------------------------------------------------------- F3: files that are not files

LOAD = "from attnslim.io import load as run"


def test_s02_weights_link_to_dev_zero_is_refused(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to("/dev/zero")
    _refused_quickly(LOAD, d, "model.safetensors is a device, FIFO or socket")


def test_s03_weights_fifo_is_refused(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")
    _refused_quickly(LOAD, d, "model.safetensors is a device, FIFO or socket")


def test_s04_config_json_dev_zero_is_refused(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    (d / "config.json").unlink()
    (d / "config.json").symlink_to("/dev/zero")
    _refused_quickly(LOAD, d, "config.json is a device, FIFO or socket")


def test_s05_compression_json_dev_zero_is_refused(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    (d / "compression.json").unlink()
    (d / "compression.json").symlink_to("/dev/zero")
    _refused_quickly(LOAD, d, "compression.json is a device, FIFO or socket")


def test_s13_report_with_config_json_dev_zero_is_refused(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    (d / "config.json").unlink()
    (d / "config.json").symlink_to("/dev/zero")
    _refused_quickly("from attnslim.report.page import write_report as run", d, "config.json is a device, FIFO")


def test_f3_tokenizer_fifo_is_refused(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    (d / "tokenizer.json").unlink()
    os.mkfifo(d / "tokenizer.json")
    _refused_quickly(LOAD, d, "tokenizer.json is a device, FIFO or socket")


# ---------------------------------------------------------------- F8: integrity that cannot be skipped

def _format_1_without_sha(d: Path) -> None:
    _edit_json(d / "compression.json", lambda v: (v.update(format_version=1), v.pop("weights_sha256")))


def test_j15_format_1_without_sha_warns_and_verify_refuses(bases, tmp_path, monkeypatch):
    d = _copy(bases, "svd", tmp_path)
    _format_1_without_sha(d)
    with pytest.warns(UserWarning, match="load UNCHECKED"):
        load(d)
    with pytest.raises(AttnslimError, match="cannot be verified"):
        load(d, verify=True)
    monkeypatch.setenv("ATTNSLIM_VERIFY", "1")
    with pytest.raises(AttnslimError, match="cannot be verified"):
        load(d)


def test_j16_format_version_true_is_refused(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    _edit_json(d / "compression.json", lambda v: (v.update(format_version=True), v.pop("weights_sha256")))
    with pytest.raises(AttnslimError, match="format_version True is not supported"):
        load(d)


def _damage_keeping_mtime(path: Path) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        f.write(bytes(64))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def test_o20_shard_damaged_in_place_with_mtime_restored_is_found(bases, tmp_path):
    d = _copy(bases, "off", tmp_path)
    load(d)  # stamps every shard
    _damage_keeping_mtime(d / "model-00003-of-00005.safetensors")
    with pytest.raises(AttnslimError, match="model-00003-of-00005.safetensors does not match the sha256"):
        load(d)


def test_n_cache_zero_cache_damaged_in_place_with_mtime_restored_is_found(tmp_path):
    from attnslim.checksum import sha256_file
    from attnslim.models import load as load_mod

    d = tmp_path / "cache" / "models" / "smollm2-135m"
    d.mkdir(parents=True)
    weights = d / load_mod.WEIGHTS
    weights.write_bytes(os.urandom(3 << 20))
    (d / load_mod.MANIFEST).write_text(json.dumps({"format": load_mod.CACHE_FORMAT, "size": 3 << 20,
                                                   "sha256": sha256_file(weights)}))
    assert load_mod._cache_problem(d) is None
    _damage_keeping_mtime(weights)
    assert load_mod._cache_problem(d) == "weights checksum mismatch"


def test_f8_stamps_expire_and_a_full_check_can_be_forced(bases, tmp_path, monkeypatch):
    import attnslim.verify as verify

    d = _copy(bases, "off", tmp_path)
    load(d)
    calls: list[Path] = []
    real = verify.sha256_file
    monkeypatch.setattr(verify, "sha256_file", lambda p: calls.append(p) or real(p))
    load(d)
    assert calls == [], "fresh stamps of unchanged files: no re-hash"
    load(d, verify=True)
    assert len(calls) == 5, "verify=True hashes every shard"
    monkeypatch.setattr(verify, "STAMP_DAYS", 0)
    load(d)
    assert len(calls) == 10, "expired stamps: every shard hashed again"


# ---------------------------------------------------------------- F9: interrupted swaps

def _leftover(parent: Path, prefix: str, dead_pid: int) -> Path:
    directory = outdir.make_temp_dir(parent, prefix)
    directory.with_name(directory.name + outdir.TEMP_MARK).write_text(str(dead_pid))
    return directory


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_r155_reading_an_emptied_out_names_both_copies(bases, tmp_path):
    from attnslim.models.load import load_model

    out = tmp_path / "out"
    out.mkdir()  # what a SIGKILL between the two renames of --overwrite leaves
    pid = _dead_pid()
    new, old = _leftover(tmp_path, ".out-", pid), _leftover(tmp_path, ".out-old-", pid)
    for copy in (new, old):
        shutil.copytree(bases / "svd", copy, dirs_exist_ok=True)
    for reader in (load, load_model):
        with pytest.raises(AttnslimError) as err:
            reader(str(out))
        assert f"the new output in {new}" in str(err.value) and f"the previous one in {old}" in str(err.value)


def test_n_stale_user_dir_is_never_named(bases, tmp_path, capsys):
    mine = tmp_path / ".bk3-mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("data")
    ours = _leftover(tmp_path, ".bk3-", _dead_pid())
    save(tiny_llama(), SavingTokenizer(), tmp_path / "bk3", {"recipe": {"name": "dense"}, "steps": []})
    err = capsys.readouterr().err
    assert str(ours) in err and "rm -rf" in err
    assert ".bk3-mine" not in err and (mine / "notes.txt").read_text() == "data"


def test_r207b_foreign_dir_during_overwrite_names_the_kept_output(bases, tmp_path, monkeypatch):
    out = _copy(bases, "svd", tmp_path)
    original = SavingTokenizer.save_pretrained

    def user_replaces_the_output(self, directory):
        original(self, directory)
        shutil.rmtree(out)
        out.mkdir()
        (out / "notes.txt").write_text("mine now")

    monkeypatch.setattr(SavingTokenizer, "save_pretrained", user_replaces_the_output)
    with pytest.raises(AttnslimError, match="The new output is kept in") as err:
        save(tiny_llama(), SavingTokenizer(), out, {"recipe": {"name": "dense"}, "steps": []}, overwrite=True)
    kept = Path(str(err.value).split("The new output is kept in ")[1].split(":")[0])
    assert (kept / "model.safetensors").is_file() and (out / "notes.txt").read_text() == "mine now"


# ---------------------------------------------------------------- F10: full disks, damaged JSON

@pytest.fixture
def small_disk(monkeypatch):
    import attnslim.offload.compute as compute

    usage = shutil.disk_usage("/")
    monkeypatch.setattr(compute.shutil, "disk_usage", lambda p: usage._replace(free=1000))


def test_k01_compress_checks_free_disk_before_the_work(bases, tmp_path, small_disk, monkeypatch):
    import attnslim.api as api

    monkeypatch.setattr(api, "compress", lambda *a, **k: pytest.fail("compressed before checking the disk"))
    with pytest.raises(AttnslimError, match="has 0.0 GiB free"):
        api.compress_to(str(bases / "hf"), one_step("svd", {"ratio": 0.5}), tmp_path / "out")


def test_k03_export_checks_free_disk_before_the_work(tmp_path, small_disk):
    from attnslim.export.deepseek import ExportOptions, export_deepseek

    with pytest.raises(AttnslimError, match="has 0.0 GiB free"):
        export_deepseek(tiny_llama(), SavingTokenizer(), tmp_path / "exp", ExportOptions())


def test_k05_report_on_a_full_disk_keeps_the_old_report(bases, tmp_path, monkeypatch):
    import attnslim.safe_files as safe_files

    d = _copy(bases, "svd", tmp_path)
    write_report(d)
    old = (d / "report.html").read_text()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safe_files.os, "fsync", disk_full)
    _edit_json(d / "compression.json", lambda v: v["recipe"].update(name="changed"))
    with pytest.raises(AttnslimError, match="No space left on device.*unchanged"):
        write_report(d)
    assert (d / "report.html").read_text() == old
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]


def test_k06_report_in_an_unwritable_dir_is_a_clear_error(bases, tmp_path, monkeypatch):
    import attnslim.safe_files as safe_files

    d = _copy(bases, "svd", tmp_path)

    def immutable(**kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(safe_files.tempfile, "mkstemp", immutable)  # chattr +i needs privileges tests lack
    with pytest.raises(AttnslimError, match="cannot create a file in"):
        write_report(d)


def test_r06r_report_html_a_directory_is_a_clear_error(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    (d / "report.html").mkdir()
    with pytest.raises(AttnslimError, match="report.html is a directory"):
        write_report(d)


@pytest.mark.parametrize("case,edit,message", [
    ("r01r", lambda v: v.pop("kv_bytes_per_token_before"), "has no 'kv_bytes_per_token_before'"),
    ("r02r", lambda v: v.update(metrics={"ppl": {"before": "abc", "after": 1}}), "is damaged (ValueError"),
    ("r03r", lambda v: v["steps"][0]["plan"]["layers"].update(abc={}), "is damaged (ValueError"),
    ("r04r", lambda v: v.update(params_before="abc"), "is damaged (TypeError"),
])
def test_r01r_r04r_report_on_damaged_json_is_a_clear_error(bases, tmp_path, case, edit, message):
    d = _copy(bases, "svd", tmp_path)
    _edit_json(d / "compression.json", edit)
    with pytest.raises(AttnslimError) as err:
        write_report(d)
    assert message in str(err.value) and not (d / "report.html").exists()


def test_j13_deeply_nested_compression_json(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    path = d / "compression.json"
    text = path.read_text().replace('"seconds":', '"notes": ' + "[" * 200_000 + "]" * 200_000 + ', "seconds":', 1)
    path.write_text(text)
    for reader in (load, write_report):
        with pytest.raises(AttnslimError, match="nested too deeply"):
            reader(d)


# ---------------------------------------------------------------- F6: config sizes against the weights

@pytest.fixture
def no_build(monkeypatch):
    """Any model built from a config fails the test: a bad size must be refused before."""
    from transformers import AutoModelForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the config's sizes were checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def test_c02_compressed_dir_with_a_million_layers_is_refused(bases, tmp_path, no_build):
    d = _copy(bases, "svd", tmp_path)
    _edit_json(d / "config.json", lambda v: v.update(num_hidden_layers=10**6))
    with pytest.raises(AttnslimError, match="num_hidden_layers 1,000,000, but the weights hold layers 0-3"):
        load(d)


def test_c03b_intermediate_size_not_in_the_weights_is_refused(bases, tmp_path, no_build):
    d = _copy(bases, "svd", tmp_path)
    _edit_json(d / "config.json", lambda v: v.update(intermediate_size=200_000))
    with pytest.raises(AttnslimError, match="intermediate_size 200,000, but no tensor"):
        load(d)


def test_c05_hf_dir_with_a_million_layers_is_refused(bases, tmp_path, no_build):
    from attnslim.models.load import load_model

    d = _copy(bases, "hf", tmp_path)
    _edit_json(d / "config.json", lambda v: v.update(num_hidden_layers=10**6))
    with pytest.raises(AttnslimError, match="num_hidden_layers 1,000,000"):
        load_model(str(d))


def test_c06_hf_dir_with_a_million_layers_offloaded_is_refused(bases, tmp_path, no_build):
    from attnslim.models.load import load_model

    d = _copy(bases, "hf", tmp_path)
    _edit_json(d / "config.json", lambda v: v.update(num_hidden_layers=10**6))
    with pytest.raises(AttnslimError, match="num_hidden_layers 1,000,000"):
        load_model(str(d), offload=True)


def test_c04_hf_hidden_size_huge_is_refused(bases, tmp_path, no_build):
    from attnslim.models.load import load_model

    d = _copy(bases, "hf", tmp_path)
    _edit_json(d / "config.json", lambda v: v.update(hidden_size=999_999_999))
    with pytest.raises(AttnslimError, match="hidden_size 999,999,999, but no tensor"):
        load_model(str(d))


def test_c09_hf_vocab_size_negative_is_refused(bases, tmp_path, no_build):
    from attnslim.models.load import load_model

    d = _copy(bases, "hf", tmp_path)
    _edit_json(d / "config.json", lambda v: v.update(vocab_size=-5))
    with pytest.raises(AttnslimError, match="vocab_size is -5, not a positive integer"):
        load_model(str(d))


def test_s14_hf_weights_that_are_not_safetensors_are_refused(bases, tmp_path):
    from attnslim.models.load import load_model

    d = _copy(bases, "hf", tmp_path)
    stand_in = tmp_path / "shadow"  # stands in for /etc/shadow
    stand_in.write_text("root:$6$abc:19000:0:99999:7:::\n" * 20)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(stand_in)
    with pytest.raises(AttnslimError, match="is not a safetensors file"):
        load_model(str(d))


def test_t06_damaged_tokenizer_json_is_a_clear_error(bases, tmp_path):
    from attnslim.models.load import load_model

    d = _copy(bases, "hf", tmp_path)
    _edit_json(d / "tokenizer.json", lambda v: v.pop("model"))
    with pytest.raises(AttnslimError, match="the tokenizer files are damaged"):
        load_model(str(d))


def test_t06_compressed_dir_with_a_damaged_tokenizer_is_a_clear_error(bases, tmp_path):
    d = _copy(bases, "svd", tmp_path)
    _edit_json(d / "tokenizer.json", lambda v: v.update(model={"type": "Bogus"}))  # tokenizers: plain Exception
    with pytest.raises(AttnslimError, match="the tokenizer files are damaged"):
        load(d)


def test_hf_dir_still_loads_and_matches(bases, tmp_path):
    """The checks above refuse nothing real: the tiny HF directory loads with its own weights."""
    from transformers import AutoModelForCausalLM

    from attnslim.models.load import load_model

    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    ours = load_model(str(bases / "hf"))[0](input_ids=ids).logits
    plain = AutoModelForCausalLM.from_pretrained(bases / "hf").eval()(input_ids=ids).logits
    assert torch.equal(ours, plain)
