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
    with bank.loaded((layer, "x")) as (got, got_norm), torch.no_grad():
        assert got is attention and got_norm is norm
        assert all(torch.equal(p, before[name]) for name, p in got.named_parameters())
        assert torch.equal(model(input_ids=IDS).logits, want)
    assert all(p.numel() == 0 for p in attention.parameters())  # spilled again after use
    with bank.loaded((layer, "x")), torch.no_grad():  # the file is read again, unchanged
        assert torch.equal(model(input_ids=IDS).logits, want)
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
