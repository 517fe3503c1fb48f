"""The planner's bank (planner/bank.py): fitted candidates wait on disk, come back bit for bit, and never take the
dense layer's own parameters with them."""

from __future__ import annotations

import pytest
import torch

from attnslim.adapters import get_adapter
from attnslim.api import compress
from attnslim.planner.bank import Bank
from conftest import tiny_llama
from helpers import ByteTokenizer, one_step

IDS = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method, args", [("mla", {"kv_ratio": 0.5, "refit_o": True}), ("nbl", {"m": 1})])
def test_banked_candidate_is_spilled_and_comes_back_bit_for_bit(method: str, args: dict[str, object]) -> None:
    model = tiny_llama()
    adapter = get_adapter(model)
    dense_layer = 1 if method == "mla" else None
    compress(model, ByteTokenizer(), one_step(method, args, [1] if dense_layer else "all"), progress=False)
    layer = dense_layer if dense_layer is not None else next(
        i for i in range(adapter.num_layers()) if type(adapter.attention(i)).__module__.startswith("attnslim."))
    attention, norm = adapter.attention(layer), adapter.attention_norm(layer)
    with torch.no_grad():
        want = model(input_ids=IDS).logits
    shared = {id(p) for name, p in adapter.decoder_layers()[layer].named_parameters() if "mlp" in name}
    before = {name: p.detach().clone() for name, p in attention.named_parameters()}
    bank = Bank()
    bank.put((layer, "x"), attention, norm, shared)
    assert (layer, "x") in bank and len(bank) == 1
    assert bank.disk_bytes() >= sum(4 * t.numel() for t in before.values())  # float32 weights, on disk
    assert all(p.numel() == 0 for p in attention.parameters())  # its own weights left memory
    assert all(p.numel() > 0 for p in adapter.decoder_layers()[layer].mlp.parameters())  # the layer's stay
    seen: dict[str, bool] = {}

    def compare(module: torch.nn.Module, args: object) -> None:  # the weights as the call reads them
        seen.update({name: torch.equal(p, before[name]) for name, p in module.named_parameters()})

    with bank.on_call((layer, "x")) as (got, got_norm), torch.no_grad():  # read in for each call only
        assert got is attention and got_norm is norm
        assert all(p.numel() == 0 for p in attention.parameters())
        hook = attention.register_forward_pre_hook(compare)
        assert torch.equal(model(input_ids=IDS).logits, want)
        hook.remove()
        assert seen and all(seen.values()), seen  # bit for bit
        assert all(p.numel() == 0 for p in attention.parameters())  # spilled again after use
        assert torch.equal(model(input_ids=IDS).logits, want)  # the file is read again, unchanged
    bank.close()


def test_a_full_disk_is_a_clear_error_that_names_tmpdir(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnslim.errors import AttnslimError
    from attnslim.planner import bank as bank_module

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    model = tiny_llama()
    adapter = get_adapter(model)
    monkeypatch.setattr(bank_module, "save_file", full)
    with pytest.raises(AttnslimError, match=r"mla@0.5 of layer 2 .* set TMPDIR to a directory with more free space"):
        Bank().put((2, "mla@0.5"), adapter.attention(2), adapter.attention_norm(2), set())
    assert all(p.numel() > 0 for p in adapter.attention(2).parameters())  # nothing was emptied


def test_offloaded_plan_measures_and_chooses_what_the_in_memory_plan_does(tmp_path: object) -> None:
    """`plan --offload`: the weights stay on disk (one decoder layer read in at a time, the layers above streamed
    through each score) and every candidate's KL, the whole-plan scores and the plan equal the in-memory run's."""
    from pathlib import Path

    from attnslim.planner.output import offloaded_for_plan
    from attnslim.planner.run import PlanConfig, plan_model
    from attnslim.recipe import Calibration, recipe_to_dict
    from conftest import TINY_BUILDERS
    from helpers import SavingTokenizer

    ckpt = Path(str(tmp_path)) / "ckpt"
    TINY_BUILDERS["llama"]().save_pretrained(ckpt)
    SavingTokenizer().save_pretrained(ckpt)
    cfg = PlanConfig(kv=0.6, kinds=("keep", "mla", "nbl", "drop"), ladder=(0.25, 0.5), score_windows=2,
                     refine_windows=2, rounds=1, calibration=Calibration(source="tiny", windows=8, seq_len=256))
    from attnslim.models.load import load_model

    model, tokenizer = load_model(str(ckpt))
    dense = plan_model(model, tokenizer, cfg, progress=False)
    with offloaded_for_plan(str(ckpt)) as (skeleton, tok, residency):
        offloaded = plan_model(skeleton, tok, cfg, progress=False, residency=residency)
        assert all(p.is_meta for p in skeleton.model.layers.parameters())  # nothing left in memory after
    assert recipe_to_dict(offloaded.recipe) == recipe_to_dict(dense.recipe)
    for i, row in dense.report["options"].items():
        for label, cost in row.items():
            assert offloaded.report["options"][i][label]["kl"] == pytest.approx(cost["kl"], rel=1e-4, abs=1e-9)
    for name, start in dense.report["starts"].items():
        assert offloaded.report["starts"][name]["measured"] == pytest.approx(start["measured"], rel=1e-4, abs=1e-9)


def test_cli_plan_offload_leaves_sharing_out_and_writes_the_plan(tmp_path: object,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import json
    from pathlib import Path

    from attnslim.cli import main as cli_main
    from conftest import TINY_BUILDERS
    from helpers import SavingTokenizer

    ckpt = Path(str(tmp_path)) / "ckpt"
    TINY_BUILDERS["llama"]().save_pretrained(ckpt)
    SavingTokenizer().save_pretrained(ckpt)
    out = Path(str(tmp_path)) / "plan.yaml"
    assert cli_main(["plan", str(ckpt), "--kv", "0.6", "--ladder", "0.5", "--calib-source", "tiny", "--calib-windows",
                     "4", "--score-windows", "2", "--rounds", "1", "--offload", "--out", str(out)]) == 0
    assert "--offload: candidates keep,mla,nbl,drop" in capsys.readouterr().out
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert report["used"]["kv"] <= 0.6 and all("ds" not in row for row in report["options"].values())
