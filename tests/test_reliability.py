"""Regression tests of ../shared/reviews/reliability.md (issue 19): each test names the probe's case (#N) or defect
(DN) it reproduces. No output is lost, no code runs from a model directory, nothing damaged passes silently, nothing
runs away, and bad input ends in a clear error. Tiny models only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from attnslim import outdir
from attnslim.api import compress
from attnslim.cli import main as cli_main
from attnslim.errors import AttnslimError
from attnslim.io import load, save
from conftest import tiny_llama
from helpers import ByteTokenizer, SavingTokenizer, one_step

IDS = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
NOT_ON_DISK = Path("/proc/attnslim-cannot-write/out")  # /proc takes no new entries, not even from root


def _svd(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compress(model, ByteTokenizer(), one_step("svd", {"ratio": 0.5}, layers="0:2"), progress=False)


@pytest.fixture
def saved(tmp_path):
    """A compressed tiny model saved at tmp_path/m, with its reference logits."""
    model = tiny_llama()
    report = _svd(model)
    out = save(model, SavingTokenizer(), tmp_path / "m", report.to_json())
    return out, model(input_ids=IDS).logits.detach(), report


@pytest.fixture
def no_model_loading(monkeypatch):
    import attnslim.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(attnslim.models, "load_model", refuse)


def _cli(argv, capsys):
    rc = cli_main([str(a) for a in argv])
    return rc, capsys.readouterr().err


# ---------------------------------------------------------------- 1. no output is ever lost (D1, D2, D6, D7, D8)

def test_d1_a_compressed_model_is_refused_before_any_work(saved, capsys, no_model_loading):
    out, _, report = saved
    before = (out / "model.safetensors").read_bytes()
    rc, err = _cli(["compress", out, "--recipe", "svd", "--out", out, "--overwrite"], capsys)  # case 145
    assert rc == 2 and "already compressed by attnslim" in err
    rc, err = _cli(["compress", out, "--recipe", "drop", "--out", out.parent / "again"], capsys)  # case 146
    assert rc == 2 and "already compressed" in err and not (out.parent / "again").exists()
    assert (out / "model.safetensors").read_bytes() == before
    loaded, _ = load(out)
    with pytest.raises(AttnslimError, match="already holds attnslim modules .*LowRankLinear") as refused:  # case 147
        _svd(loaded)
    fix = "compress the original model with one recipe"  # one check, one text: the directory's and the model's
    assert "already compressed by attnslim" in str(refused.value) and fix in str(refused.value) and fix in err


def test_d1_out_equal_to_the_input_is_refused(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    with pytest.raises(AttnslimError, match="is the input model"):
        outdir.check_output(src, overwrite=True, inputs=[tmp_path / "." / "hf"])


def test_d2_what_appears_at_out_while_saving_is_never_deleted(tmp_path, monkeypatch):
    """Case 207: a directory of user data created at --out during the write survives, and the finished model is
    kept in the temp directory the error names."""
    model, target = tiny_llama(), tmp_path / "out"
    original = SavingTokenizer.save_pretrained

    def user_writes_meanwhile(self, directory):
        original(self, directory)
        target.mkdir()
        (target / "precious.txt").write_text("keep me")

    monkeypatch.setattr(SavingTokenizer, "save_pretrained", user_writes_meanwhile)
    with pytest.raises(AttnslimError, match="appeared while the output was being written.*kept in") as info:
        save(model, SavingTokenizer(), target, {"recipe": {}, "steps": []})
    assert (target / "precious.txt").read_text() == "keep me" and len(list(target.iterdir())) == 1
    kept = Path(str(info.value).split("kept in ")[1].split(":")[0])
    assert (kept / "model.safetensors").is_file() and (kept / "compression.json").is_file()


def test_d2_two_concurrent_saves_never_both_report_success(tmp_path, monkeypatch):
    """Case 205: the save that finishes second fails instead of deleting the first one's result."""
    target = tmp_path / "same"
    original = SavingTokenizer.save_pretrained
    inner = []

    def second_writer_finishes_first(self, directory):
        original(self, directory)
        if not inner:
            inner.append(directory)
            save(tiny_llama(hidden_act="gelu"), SavingTokenizer(), target, {"recipe": {"n": 2}, "steps": []})

    monkeypatch.setattr(SavingTokenizer, "save_pretrained", second_writer_finishes_first)
    with pytest.raises(AttnslimError, match="appeared while"):
        save(tiny_llama(), SavingTokenizer(), target, {"recipe": {"n": 1}, "steps": []})
    assert json.loads((target / "compression.json").read_text())["recipe"] == {"n": 2}


def test_d2_overwrite_checks_again_just_before_the_swap(saved, monkeypatch):
    out, _, report = saved
    original = SavingTokenizer.save_pretrained

    def user_replaces_the_output(self, directory):
        original(self, directory)
        for f in out.iterdir():
            f.unlink()
        (out / "notes.txt").write_text("mine now")

    monkeypatch.setattr(SavingTokenizer, "save_pretrained", user_replaces_the_output)
    with pytest.raises(AttnslimError, match="not a model saved by attnslim"):
        save(tiny_llama(), SavingTokenizer(), out, report.to_json(), overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_d7_overwrite_interrupted_mid_swap_keeps_both_models(saved, monkeypatch):
    """Case 155: a kill between 'old aside' and 'new in' used to leave nothing at --out. Now the old output is put
    back and the new one stays in its temp directory."""
    out, ref, report = saved

    def killed(tmp, target):
        raise SystemExit(143)

    monkeypatch.setattr(outdir, "install_new", killed)
    with pytest.raises(SystemExit):
        save(tiny_llama(), SavingTokenizer(), out, report.to_json(), overwrite=True)
    assert torch.equal(load(out)[0](input_ids=IDS).logits, ref)
    leftovers = [p for p in out.parent.glob(".m-*") if (p / "model.safetensors").is_file()]
    assert len(leftovers) == 1  # the new model, reported by the next save (test below)


def test_d7_overwrite_replaces_by_rename(saved):
    out, ref, report = saved
    model = tiny_llama(hidden_act="gelu")
    save(model, SavingTokenizer(), out, {"recipe": {"name": "dense"}, "steps": []}, overwrite=True)
    assert torch.equal(load(out)[0](input_ids=IDS).logits, model(input_ids=IDS).logits)
    assert not list(out.parent.glob(".m-*")), "no temp or set-aside directory is left"


@pytest.mark.parametrize("case", ["parent_is_file", "parent_not_writable", "symlink", "dangling_symlink"])
def test_d6_unwritable_or_symlinked_out_is_refused_before_work(tmp_path, capsys, no_model_loading, case):
    """Cases 139-144: each used to fail only after the whole compress."""
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "compression.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "model")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    out, message = {
        "parent_is_file": (tmp_path / "run.sh" / "sub", "is not a directory"),
        "parent_not_writable": (NOT_ON_DISK, "cannot write in"),
        "symlink": (tmp_path / "link", "is a symbolic link"),
        "dangling_symlink": (tmp_path / "dangling", "is a symbolic link"),
    }[case]
    rc, err = _cli(["compress", "--recipe", "svd", "--out", out, "--overwrite"], capsys)
    assert rc == 2 and message in err
    assert (tmp_path / "model" / "compression.json").read_text() == "{}"


def test_d6_demo_checks_out_first_and_needs_overwrite(saved, monkeypatch):
    """Case 149: demo replaced an existing attnslim directory (and the user's NOTES.md in it) without --overwrite."""
    import attnslim.models
    from attnslim.demo import run_demo

    out, _, _ = saved
    (out / "NOTES.md").write_text("mine")
    monkeypatch.setattr(attnslim.models, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    with pytest.raises(AttnslimError, match="exists; choose another --out or pass --overwrite"):
        run_demo("smollm2-135m", "default", str(out), 64)
    assert (out / "NOTES.md").read_text() == "mine"


def test_d8_sigterm_during_a_write_removes_the_temp_directory(tmp_path):
    """Case 154: SIGTERM (timeout, Slurm, docker stop) now cleans up like Ctrl-C."""
    script = (
        "import sys, time\nfrom pathlib import Path\nfrom attnslim.outdir import staged_output, terminate_as_exit\n"
        "with terminate_as_exit():\n"
        f"    with staged_output(Path({str(tmp_path / 'out')!r}), False) as tmp:\n"
        "        (tmp / 'part').write_bytes(b'x' * 1000)\n"
        "        print('writing', flush=True)\n"
        "        time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_d8_the_next_save_reports_what_a_sigkill_left(saved, capsys):
    out, _, report = saved
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = out.parent / ".m-killed"
    stale.mkdir()
    (out.parent / (stale.name + outdir.TEMP_MARK)).write_text(dead.stdout.strip())  # marked as attnslim's
    (stale / "model.safetensors").write_bytes(b"x" * 2**20)
    save(tiny_llama(), SavingTokenizer(), out, report.to_json(), overwrite=True)
    err = capsys.readouterr().err
    assert "1 temporary directory (1 MB) left by an interrupted write" in err and str(stale) in err
    assert stale.is_dir(), "reported, never deleted: it may hold the only copy of a model"


def test_d15_outputs_follow_the_umask(saved):
    out, _, _ = saved
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask
    assert ((out / "model.safetensors").stat().st_mode & 0o777) == 0o666 & ~umask


# ---------------------------------------------------------------- 2. no code from a model directory (D3, D4)

_PAYLOAD = "from pathlib import Path\nPath({flag!r}).write_text('pwned')\n"


def test_d3_auto_map_entries_in_a_compressed_dir_never_run(saved, tmp_path):
    """Cases 195-199: config.json / tokenizer_config.json auto_map pointing at the directory's own .py files."""
    out, ref, _ = saved
    flag = tmp_path / "PWNED"
    (out / "evil.py").write_text(_PAYLOAD.format(flag=str(flag)) + "class Evil: pass\n")
    config = json.loads((out / "config.json").read_text())
    config["auto_map"]["AutoConfig"] = "evil.Evil"
    (out / "config.json").write_text(json.dumps(config))
    tok = json.loads((out / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": [None, "evil.Evil"]}
    (out / "tokenizer_config.json").write_text(json.dumps(tok))
    try:
        model, _ = load(out)
        assert torch.equal(model(input_ids=IDS).logits, ref)
    except AttnslimError:
        pass  # refusing is fine too; running the file is not
    assert not flag.exists()


def test_d3_a_plain_hf_dir_with_remote_code_is_refused_not_run(tmp_path, capsys):
    from attnslim.models import load_model

    d, flag = tmp_path / "hf", tmp_path / "PWNED"
    tiny_llama().save_pretrained(d)
    SavingTokenizer().save_pretrained(d)
    (d / "evil_cfg.py").write_text(_PAYLOAD.format(flag=str(flag)))
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil_cfg.EvilConfig"}
    config["model_type"] = "evil"
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(AttnslimError, match="could not be loaded as a Hugging Face model"):
        load_model(str(d))
    assert not flag.exists()


def test_d4_transformers_without_remote_code_fails_loudly(saved):
    """Case 200: used to return a dense Llama with random attention in the compressed layers."""
    from transformers import AutoModelForCausalLM

    out, ref, _ = saved
    assert json.loads((out / "config.json").read_text())["model_type"] == "attnslim"
    with pytest.raises(ValueError, match="custom code|trust_remote_code|does not recognize"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert torch.equal(model(input_ids=IDS).logits, ref)


def test_directories_of_format_1_still_load(saved):
    """Directories saved before this change (base model_type, no weights sha256) load unchanged."""
    out, ref, _ = saved
    config = json.loads((out / "config.json").read_text())
    config["model_type"] = config.pop("attnslim_base_model_type")
    config["auto_map"] = {"AutoModelForCausalLM": "attnslim_hf.AttnslimForCausalLM"}
    (out / "config.json").write_text(json.dumps(config))
    info = json.loads((out / "compression.json").read_text())
    info["format_version"] = 1
    del info["weights_sha256"]
    (out / "compression.json").write_text(json.dumps(info))
    assert torch.equal(load(out)[0](input_ids=IDS).logits, ref)


# ---------------------------------------------------------------- 3. no silent corruption (D5, D13, D14)

def test_d5_damage_in_the_middle_of_saved_weights_is_found(saved):
    """Case 166: 4 KiB in the middle of model.safetensors used to load and give ppl nan."""
    out, _, _ = saved
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 4096] = b"\x7f" * 4096
    weights.write_bytes(bytes(data))
    with pytest.raises(AttnslimError, match="does not match the sha256 recorded"):
        load(out)


def test_d5_cache_runs_a_full_sha256_once_per_new_file(tmp_path, monkeypatch):
    """Cases 214-215: damage in the middle of the cached dense weights was never detected."""
    from attnslim.checksum import sha256_file
    from attnslim.models import load as load_mod

    monkeypatch.setenv("ATTNSLIM_CACHE", str(tmp_path))
    d = tmp_path / "models" / "smollm2-135m"
    d.mkdir(parents=True)
    weights = d / load_mod.WEIGHTS
    weights.write_bytes(b"x" * (3 << 20))
    (d / load_mod.MANIFEST).write_text(json.dumps({"format": load_mod.CACHE_FORMAT, "size": 3 << 20,
                                                   "sha256": sha256_file(weights)}))
    assert load_mod._cache_problem(d) is None
    hashed = []
    monkeypatch.setattr(load_mod, "sha256_file", lambda p: hashed.append(p) or "")
    assert load_mod._cache_problem(d) is None and hashed == [], "an unchanged file is not hashed again"
    monkeypatch.undo()
    monkeypatch.setenv("ATTNSLIM_CACHE", str(tmp_path))
    time.sleep(0.01)
    with open(weights, "r+b") as f:  # same size, middle MiB zeroed
        f.seek(1 << 20)
        f.write(b"\0" * (1 << 20))
    assert load_mod._cache_problem(d) == "weights checksum mismatch"


def test_d5_eval_refuses_a_perplexity_that_is_not_finite_and_names_the_site():
    from attnslim.data import TokenWindows
    from attnslim.eval import perplexity

    windows = TokenWindows(ids=IDS.repeat(2, 1), source="tiny", split="eval", description="test")
    model = tiny_llama()
    handle = model.model.layers[2].register_forward_hook(
        lambda m, a, out: out * float("nan") if isinstance(out, torch.Tensor) else (out[0] * float("nan"),) + out[1:]
    )
    with pytest.raises(AttnslimError, match="not finite: decoder layer 2 produced NaN/Inf"):
        perplexity(model, windows, progress=False)
    handle.remove()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3] = float("nan")
    with pytest.raises(AttnslimError, match="parameter model.layers.1.mlp.down_proj.weight holds NaN/Inf"):
        perplexity(model, windows, progress=False)


def test_d14_identical_runs_write_identical_bytes(tmp_path):
    """Case 202: safetensors' tied-weight metadata order depended on PYTHONHASHSEED."""
    script = (
        "import sys; sys.path[:0] = ['tests']\n"
        "from conftest import tiny_llama\nfrom helpers import SavingTokenizer\nfrom attnslim.io import save\n"
        "save(tiny_llama(), SavingTokenizer(), sys.argv[1], {'recipe': {}, 'steps': []})\n"
    )
    root = Path(__file__).parents[1]
    digests = set()
    for seed in ("1", "2", "3"):
        out = tmp_path / f"s{seed}"
        subprocess.run([sys.executable, "-c", script, str(out)], check=True, cwd=root,
                       env={**os.environ, "PYTHONHASHSEED": seed})
        digests.add((out / "model.safetensors").read_bytes())
    assert len(digests) == 1
    loaded = load(tmp_path / "s1")[0]  # the tied head, stored once, is tied again on load
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("override,message", [
    ("steps.0.args.ratio=true", "ratio=True is a bool; expected a number"),  # case 39
    ("steps.0.args.linears=qkvo", "linears='qkvo' is a str; expected a list"),  # case 79
    ("steps.0.args.linears=gate", "linears='gate' is a str"),  # case 80
    ("steps.0.args.ratio=abc", "ratio='abc' is a str"),  # case 36
    ("steps.0.args.ratio='\"0.5\"'", "is a str; expected a number"),  # case 37
    ("steps.0.args.ratio=[0.5]", "ratio=[0.5] is a list"),  # case 38
    ("steps.0.args.damp=abc", "damp='abc' is a str"),  # case 82
    ("steps.0.args.damp=.inf", "damp=inf is invalid; valid: a finite number"),  # case 83
])
def test_d11_d13_method_arguments_are_checked_before_loading(override, message, tmp_path, capsys, no_model_loading):
    rc, err = _cli(["compress", "--recipe", "svdllm", "--set", override, "--out", tmp_path / "x"], capsys)
    assert rc == 2 and message in err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("recipe,override,message", [
    ("asvd", "steps.0.args.alpha=x", "alpha='x' is a str"),  # case 84
    ("drop", "steps.0.args.count='\"3\"'", "count='\"3\"' is a str; expected an integer"),  # case 85
    ("svd", "steps.0.args.bogus=1", "unknown argument(s) ['bogus']"),  # case 17, before the model loads
    ("svd", "steps.0.method=nosuch", "unknown method 'nosuch'"),  # case 18, before the model loads
])
def test_d12_recipe_errors_come_before_the_model_loads(recipe, override, message, tmp_path, capsys,
                                                       no_model_loading):
    rc, err = _cli(["compress", "--recipe", recipe, "--set", override, "--out", tmp_path / "x"], capsys)
    assert rc == 2 and message in err


def test_d13_empty_data_is_an_error(capsys, no_model_loading):
    rc, err = _cli(["eval", "--data", ""], capsys)  # case 90
    assert rc == 2 and "names no text source" in err


# ---------------------------------------------------------------- 4. no runaway memory or time (D9, D10)

def test_d9_bench_refuses_contexts_beyond_the_positions_and_keeps_one_logit():
    from attnslim.bench import interleaved
    from attnslim.bench.speed import time_prefill_decode

    model = tiny_llama()  # 256 positions
    with pytest.raises(AttnslimError, match="exceeds the model's 256 positions"):
        interleaved({"m": model}, [300], new_tokens=4, repeats=1)
    shapes = []
    model.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.logits.shape)))
    time_prefill_decode(model, IDS, new_tokens=2)
    assert shapes[0] == (1, 1, 128), "prefill computes the vocabulary projection at the last position only"


def test_d9_generate_refuses_prompts_beyond_the_positions():
    from attnslim.generate import generate_text

    class Long(ByteTokenizer):
        eos_token_id = 0

        def __call__(self, text, **kw):
            return type("T", (), {"input_ids": torch.zeros(1, 300, dtype=torch.long)})()

    with pytest.raises(AttnslimError, match="prompt \\+ new tokens = 340 tokens exceeds"):
        generate_text(tiny_llama(), Long(), "x", 40)


def test_d10_recipe_aliases_are_refused(tmp_path):
    from attnslim.recipe import load_recipe

    bomb = tmp_path / "bomb.yaml"
    lines = ["name: bomb", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join(['*a' + str(i - 1)] * 10)}]" for i in range(1, 8)]
    lines += ["steps: [{method: svd, args: {ratio: 0.5, bogus: *a7}}]"]
    bomb.write_text("\n".join(lines))
    with pytest.raises(AttnslimError, match="aliases \\(\\*name\\) are not allowed"):
        load_recipe(bomb)


# ---------------------------------------------------------------- 5. clear errors instead of tracebacks (D11, D12)

def test_d11_non_utf8_recipe_and_text(tmp_path, capsys, no_model_loading):
    from attnslim.data.sources import load_text

    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("name: caf\xe9\n".encode("latin-1"))
    rc, err = _cli(["compress", "--recipe", bad, "--out", tmp_path / "x"], capsys)  # case 25
    assert rc == 2 and "is not UTF-8 text" in err
    text = tmp_path / "latin1.txt"
    text.write_bytes(("caf\xe9 " * 50 + "\n\n") .encode("latin-1") * 4)
    with pytest.raises(AttnslimError, match="is not UTF-8 text"):  # cases 96, 97, 100
        load_text(f"file:{text}", "calib")
    with pytest.raises(AttnslimError, match="is a directory"):  # case 98
        load_text(f"file:{tmp_path}", "calib")
    rc, err = _cli(["compress", "--recipe", tmp_path, "--out", tmp_path / "x"], capsys)  # case 27
    assert rc == 2 and "is a directory" in err


def test_d11_empty_prompt(capsys, no_model_loading):
    rc, err = _cli(["generate", "--prompt", ""], capsys)  # case 114
    assert rc == 2 and "--prompt is empty" in err


@pytest.mark.parametrize("damage,message", [
    ("config_deleted", "config.json does not exist"),  # case 185
    ("json_minimal", "records no valid weights_sha256"),  # case 171
    ("plan_rank_text", "step 1 (svd) layer 0: the plan entry"),  # case 177: names the step, layer and entry
    ("weights_deleted", "model.safetensors does not exist"),  # case 160
    ("hidden_size_66", "says hidden_size 66, but no tensor"),  # case 191 (now refused before the config is built)
    ("no_auto_map", None),  # case 189: loads
])
def test_d11_damaged_directories_name_the_damage(saved, damage, message):
    out, ref, _ = saved
    info = json.loads((out / "compression.json").read_text())
    if damage == "config_deleted":
        (out / "config.json").unlink()
    elif damage == "json_minimal":
        (out / "compression.json").write_text(json.dumps({"format_version": 2}))
    elif damage == "plan_rank_text":
        entry = next(iter(info["steps"][0]["plan"]["layers"].values()))
        entry[next(iter(entry))] = "os.system"
        (out / "compression.json").write_text(json.dumps(info))
    elif damage == "weights_deleted":
        (out / "model.safetensors").unlink()
    elif damage == "hidden_size_66":
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "hidden_size": 66}))
    else:
        config = json.loads((out / "config.json").read_text())
        del config["auto_map"]
        (out / "config.json").write_text(json.dumps(config))
    if message is None:
        assert torch.equal(load(out)[0](input_ids=IDS).logits, ref)
        return
    with pytest.raises(AttnslimError) as info_:
        load(out)
    assert message in str(info_.value)


def test_d11_cache_problems_are_named_before_the_conversion(tmp_path, monkeypatch):
    from attnslim.models import load as load_mod
    from attnslim.models.zoo import ZOO, cache_root

    monkeypatch.setattr(load_mod, "_convert", lambda *a: pytest.fail("converted before the check"))
    d = tmp_path / "models" / "smollm2-135m"
    d.mkdir(parents=True)
    (d / load_mod.MANIFEST).write_text("[1, 2]")  # case 217
    monkeypatch.setenv("ATTNSLIM_CACHE", str(tmp_path))
    assert "not a JSON object" in load_mod._cache_problem(d)
    monkeypatch.setenv("ATTNSLIM_CACHE", str(NOT_ON_DISK))  # case 218: a cache that cannot be written
    with pytest.raises(AttnslimError, match="cannot write in"):
        load_mod.ensure_cached(ZOO["smollm2-135m"])
    monkeypatch.setenv("ATTNSLIM_CACHE", "")  # case 222
    with pytest.raises(AttnslimError, match="ATTNSLIM_CACHE is set but empty"):
        cache_root()
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("ATTNSLIM_CACHE", str(tmp_path / "file"))  # case 221
    with pytest.raises(AttnslimError, match="is not a directory"):
        cache_root()


def test_d12_local_path_typos_and_incomplete_dirs_fail_fast(tmp_path, monkeypatch):
    from attnslim.models import load as load_mod

    monkeypatch.setattr(load_mod, "_load_hub", lambda *a: pytest.fail("went to the hub for a local path"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "det").mkdir()
    with pytest.raises(AttnslimError, match="the local path does not exist"):  # case 7
        load_mod.load_model("det/svdlm_1")
    only_config = tmp_path / "cfg"
    tiny_llama().config.save_pretrained(only_config)
    with pytest.raises(AttnslimError, match="has no tokenizer files"):  # cases 10, 11
        load_mod.load_model(str(only_config))


def test_wrapped_errors_quote_the_first_line_and_survive_an_empty_message() -> None:
    """AttnslimErrors quote the library error they wrap by its first line (errors.first_line); an exception
    without a message gave `str(err).splitlines()[0]` an IndexError, which hid the real error."""
    from attnslim.errors import first_line

    assert first_line(RuntimeError("  first\nsecond  ")) == "first"
    assert first_line(RuntimeError("x" * 50), 10) == "x" * 10
    assert first_line(RuntimeError()) == ""
