"""Hugging Face out and in: exact name mapping, export loadable by transformers with the
same logits, --init-from reproducing the first loss, bit-identical round trips."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shoal.cli import main
from shoal.data import DataConfig, get_micro_batch, load_data
from shoal.data.prepare import PrepareConfig, prepare
from shoal.errors import ShoalError
from shoal.hf.convert import (
    hf_to_shoal,
    load_hf_dir,
    model_config_from_hf,
    shoal_to_hf,
    write_hf_dir,
)
from shoal.model.config import get_preset
from shoal.model.transformer import build_model
from shoal.train.checkpoint import load_checkpoint

RUN = ["--steps", "2", "--micro-batches", "2", "--micro-batch-size", "2", "--seq-len", "32",
       "--eval-batches", "1", "--quiet"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hfdata")
    rng = np.random.default_rng(0)
    words = ["shoal", "fish", "swim", "in", "the", "sea", "and", "rivers", "of", "light"]
    (d / "a.txt").write_text("".join(" ".join(words[i] for i in rng.integers(0, 10, 12)) + ".\n"
                                     for _ in range(4000)))
    out = d / "data"
    prepare(PrepareConfig(inputs=(str(d / "a.txt"),), out=str(out), vocab_size=400, quiet=True))
    return out


def test_round_trip_is_bit_identical(tmp_path):
    cfg = get_preset("tiny")
    state = {k: v.detach().clone() for k, v in build_model(cfg, seed=3).state_dict().items()}
    back = hf_to_shoal(shoal_to_hf(state, cfg), cfg)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    write_hf_dir(tmp_path / "m", state, cfg)
    cfg2, loaded = load_hf_dir(tmp_path / "m")
    assert cfg2.to_dict() == {**cfg.to_dict(), "name": "hf"}
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    # and back out again: the same file bytes
    write_hf_dir(tmp_path / "m2", loaded, cfg2)
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (tmp_path / "m2" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("change,expect", [
    ({"model_type": "gpt2"}, "not a 'llama'"),
    ({"num_key_value_heads": 2}, "grouped-query"),
    ({"attention_bias": True}, "biases"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope scaling"),
])
def test_unsupported_configs_are_refused(change, expect):
    from shoal.hf.convert import hf_config

    d = {**hf_config(get_preset("tiny")), **change}
    with pytest.raises(ShoalError, match=expect):
        model_config_from_hf(d)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_export_loads_in_transformers_and_init_from_continues(tmp_path, data_dir, capsys):
    transformers = pytest.importorskip("transformers")
    run = tmp_path / "run"
    assert main(["train", "--local", "--data", str(data_dir), *RUN, "--out", str(run)]) == 0
    hf = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(hf)]) == 0
    assert "exported step 2" in capsys.readouterr().out
    ck = load_checkpoint(run / "checkpoint")
    cfg = get_preset("tiny")
    ours = build_model(cfg)
    ours.load_state_dict(ck.model_state)
    ours.eval()

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf))
    model.eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    data = load_data(DataConfig(paths=(str(data_dir),)), cfg.vocab_size)
    x, _ = get_micro_batch(data, "val", 0, 0, 0, 4, 64)
    with torch.no_grad():
        worst = float((ours(x) - model(x).logits).abs().max())
    print(f"max |logits shoal - transformers| = {worst:.3g}")
    assert worst <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    # The class docs/data.md names (PreTrainedTokenizerFast is another name for it).
    assert type(tok).__name__ == "TokenizersBackend" and isinstance(tok, transformers.PreTrainedTokenizerFast)
    text = "the shoal swims in rivers of light"
    assert tok(text).input_ids == data.encode(text)
    assert json.loads((hf / "config.json").read_text())["shoal"]["step"] == 2

    # --init-from the export: the first loss is the exported weights' loss on step 0's batches.
    run2 = tmp_path / "run2"
    assert main(["train", "--local", "--data", str(data_dir), "--init-from", str(hf), *RUN, "--out", str(run2)]) == 0
    first = json.loads((run2 / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    with torch.no_grad():
        want = sum(float(ours(*get_micro_batch(data, "train", 0, 0, mb, 2, 32))) for mb in range(2)) / 2
    assert abs(first - want) <= 1e-6, (first, want)
    # Export of the continued run, imported again: the same weights bit for bit.
    hf2 = tmp_path / "hf2"
    assert main(["export", str(run2), "--out", str(hf2)]) == 0
    _, back = load_hf_dir(hf2)
    ck2 = load_checkpoint(run2 / "checkpoint").model_state
    assert all(torch.equal(back[k], ck2[k]) for k in ck2)
    # --model and --init-from together is a one-line error.
    rc = main(["train", "--local", "--init-from", str(hf), "--model", "tiny", "--out", str(tmp_path / "r3")])
    assert rc == 2 and "drop --model" in capsys.readouterr().err
