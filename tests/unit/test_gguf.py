"""`slimtune export RUN --gguf FILE`: the file read back by transformers' own GGUF loader (which
dequantizes it and undoes llama.cpp's query/key row order) gives the model's logits, and its
tokenizer the same ids.

Tolerances: f16 and bf16 round each weight once (relative 2^-11 and 2^-8), so the logits agree to
1e-2 relative. q8_0 is held to what it is by design: every weight within its block's bound (below),
and the logits equal, to float32 arithmetic, those of the same model with each weight put through
q8_0 and back.

The real SmolLM2-135M takes transformers' reader about 30 s, so it is a benchmark case
(benchmarks/cases/gguf_export.py, which also runs the files in llama.cpp), not a test here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import save_tiny_model, tiny_config
from slimtune import cli, export
from slimtune.export_gguf import layout as layouts, writer
from slimtune.model.stack import load_model, load_tokenizer

DEMO = Path(__file__).resolve().parents[2] / "slimtune" / "demo" / "base"
TEXT = "the quick brown fox, question: what is two plus two? answer: 4 <s> hello world"
RELATIVE = {"f16": 1e-2, "bf16": 1e-2}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def read_back(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def random_model(family: str, tokenizer, **overrides):
    """A tiny model of `family` whose norms and biases are random too (they start as ones and zeros,
    which a mix-up of them would not show)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer), **overrides)).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if tensor.dim() == 1:
                tensor.copy_(torch.randn_like(tensor) * 0.1 + ("norm" in name))
    return model


def test_rotary_row_order_keeps_attention_scores():
    """llama.cpp rotates adjacent pairs (2i, 2i+1) where Hugging Face rotates halves (i, i + d/2): with
    the rows reordered, every head's query-key scores at every pair of positions are the same."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    heads, kv_heads, d, width, steps = 4, 2, 8, 16, 5
    wq, wk = torch.randn(heads * d, width, dtype=torch.float64), torch.randn(kv_heads * d, width, dtype=torch.float64)
    x = torch.randn(steps, width, dtype=torch.float64)
    angles = torch.arange(steps, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    emb = torch.cat([angles, angles], dim=-1)
    q, k = (x @ wq.T).view(steps, heads, d).transpose(0, 1), (x @ wk.T).view(steps, kv_heads, d).transpose(0, 1)
    q, k = apply_rotary_pos_emb(q[None], k[None], emb.cos()[None], emb.sin()[None])
    hf_scores = q[0] @ k[0].repeat_interleave(heads // kv_heads, 0).transpose(-1, -2)

    def adjacent_pairs(rows: torch.Tensor) -> torch.Tensor:  # llama.cpp's rope on (H, T, d)
        even, odd = rows[..., 0::2], rows[..., 1::2]
        cos, sin = angles.cos(), angles.sin()
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    q2 = (x @ layouts.interleave_rotary_pairs(wq, heads).T).view(steps, heads, d).transpose(0, 1)
    k2 = (x @ layouts.interleave_rotary_pairs(wk, kv_heads).T).view(steps, kv_heads, d).transpose(0, 1)
    cpp_scores = adjacent_pairs(q2) @ adjacent_pairs(k2).repeat_interleave(heads // kv_heads, 0).transpose(-1, -2)
    torch.testing.assert_close(cpp_scores, hf_scores)
    plain = (x @ wq.T).view(steps, heads, d).transpose(0, 1)
    unordered = adjacent_pairs(plain) @ adjacent_pairs(plain).transpose(-1, -2)
    assert not torch.allclose(unordered, q[0] @ q[0].transpose(-1, -2)), "without the reorder the scores differ"


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO, torch.float32, torch.device("cpu")).eval(), load_tokenizer(DEMO)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_demo_model_reads_back_with_its_logits_and_tokenizer(demo, tmp_path, kind):
    from transformers import AutoTokenizer

    model, tokenizer = demo
    path = writer.write(model, tokenizer, tmp_path / "demo.gguf", kind, "demo", progress=False).path
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    assert relative_error(logits(read_back(path), ids), logits(model, ids)) < RELATIVE[kind]
    read_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert read_tokenizer(TEXT)["input_ids"] == ids[0].tolist()  # the BOS the demo tokenizer adds included
    assert read_tokenizer.decode(ids[0], skip_special_tokens=True) == tokenizer.decode(ids[0], skip_special_tokens=True)


def q8_0_round_trip(weight: torch.Tensor) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    array = weight.detach().float().numpy()
    return torch.from_numpy(quants.dequantize(quants.quantize(array, GGMLQuantizationType.Q8_0),
                                              GGMLQuantizationType.Q8_0)).reshape(weight.shape)


def test_q8_0_weights_within_their_block_bound_and_logits_of_the_rounded_model(demo, tmp_path):
    """q8_0 stores 32 values as an f16 scale d = max|x|/127 and round(x/d): each value is off by at most
    d/2 from rounding, plus 127 times the f16 rounding of d (2^-11 relative, 2^-25 absolute below f16's
    normal range)."""
    import copy

    from gguf import GGUFReader, dequantize

    model, tokenizer = demo
    path = writer.write(model, tokenizer, tmp_path / "demo.gguf", "q8_0", "demo", progress=False).path
    state = model.state_dict()
    stored = {t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()) for t in GGUFReader(path).tensors}
    for planned in layouts.plan_tensors(model, layouts.layout_of(model.config)):
        want = planned.tensor().float()
        got = stored[planned.name].reshape(want.shape)
        if want.dim() == 1:
            assert torch.equal(got, want), planned.name  # norms stay float32
            continue
        blocks = want.reshape(-1, 32)
        scale = blocks.abs().amax(dim=1, keepdim=True) / 127
        bound = scale * (0.5 + 127 * 2.0**-11) + 127 * 2.0**-25 + 1e-6 * scale * 127
        assert ((got.reshape(-1, 32) - blocks).abs() <= bound).all(), planned.name
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, tensor in rounded.named_parameters():
            if tensor.dim() == 2:
                tensor.copy_(q8_0_round_trip(state[name]))
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    back = logits(read_back(path), ids)
    assert relative_error(back, logits(rounded, ids)) < 1e-5
    assert 1e-4 < relative_error(back, logits(model, ids)) < 2e-2  # rounded, as q8_0 is, and not far


def test_q8_0_in_pieces_is_the_whole_tensor_quantized(monkeypatch):
    from gguf import GGMLQuantizationType, quants

    weight = torch.randn(10, 96)
    whole = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    monkeypatch.setattr(writer, "QUANTIZE_VALUES", 3 * 96)  # 3 rows a piece: 4 pieces, the last short
    assert (writer.encode(weight, GGMLQuantizationType.Q8_0) == whole).all()


@pytest.mark.parametrize("family, overrides", [
    ("qwen2", {"tie_word_embeddings": True}),  # q/k/v biases, the head tied to the embedding
    ("qwen3", {"head_dim": 128, "tie_word_embeddings": False}),  # q/k norms; transformers' reader takes
    # Qwen3's head_dim from its config class (128), not the file's key_length, so the tiny model uses 128
    ("mistral", {"sliding_window": None}),
])
def test_family_reads_back_with_its_logits(tokenizer, tmp_path, family, overrides):
    from transformers import AutoTokenizer

    model = random_model(family, tokenizer, **overrides)
    path = writer.write(model, tokenizer, tmp_path / f"{family}.gguf", "f16", f"tiny-{family}", progress=False).path
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    back = read_back(path)
    assert back.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert relative_error(logits(back, ids), logits(model, ids)) < RELATIVE["f16"]
    read_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert read_tokenizer(TEXT)["input_ids"] == ids[0].tolist()


@pytest.mark.quick
def test_every_tensor_of_a_llama_with_biases_and_its_own_head_lands_under_its_name(tokenizer, tmp_path):
    """transformers' reader has no attention_bias for llama, so the file is read tensor by tensor:
    each dequantizes to the model's own (query and key rows in llama.cpp's order), and the settings
    llama.cpp reads are the config's."""
    from gguf import GGUFReader

    model = random_model("llama", tokenizer, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    path = writer.write(model, tokenizer, tmp_path / "llama.gguf", "f16", "llama", progress=False).path
    reader = GGUFReader(path)
    stored = {t.name: torch.from_numpy(t.data.astype("float32")) for t in reader.tensors}
    q = model.model.layers[1].self_attn.q_proj
    torch.testing.assert_close(stored["blk.1.attn_q.bias"], layouts.interleave_rotary_pairs(q.bias.detach(), 4))
    torch.testing.assert_close(stored["blk.1.attn_q.weight"].reshape(q.weight.shape),
                               layouts.interleave_rotary_pairs(q.weight.detach(), 4).half().float())
    torch.testing.assert_close(stored["blk.0.ffn_down.bias"], model.model.layers[0].mlp.down_proj.bias.detach())
    torch.testing.assert_close(stored["output.weight"].reshape(model.lm_head.weight.shape),
                               model.lm_head.weight.detach().half().float())
    assert len(stored) == len(model.state_dict())
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert (field("general.architecture"), field("llama.block_count"), field("llama.attention.head_count_kv"),
            field("llama.rope.dimension_count"), field("tokenizer.ggml.model")) == ("llama", 2, 2, 8, "gpt2")


SPLIT_TEXT = "we paid 123 and 4567 for it.\n\nI'LL say:hello 89"


def with_pre_tokenizer(steps: list):
    """A byte-level BPE tokenizer trained (GPT-2's split) on numbers after spaces, so that it holds
    tokens like "Ġ12" that other splits never form, then set to split text by `steps`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([SPLIT_TEXT, "paid 12 34 567 and 4567, 89 123 for it"] * 20, trainer)
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe"])
def test_a_split_llama_cpp_knows_by_name_reads_back_splitting_alike(tokenizer, tmp_path, name):
    from gguf import GGUFReader
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoTokenizer

    from slimtune.export_gguf import vocab

    pattern = next(regex for regex, known in vocab.SPLITS.items() if known == name)
    split = with_pre_tokenizer([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    gpt2 = with_pre_tokenizer([pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert split(SPLIT_TEXT)["input_ids"] != gpt2(SPLIT_TEXT)["input_ids"]  # the split shows in the ids
    model = random_model("qwen2", split)
    path = writer.write(model, split, tmp_path / "t.gguf", "f16", "t", progress=False).path
    assert GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == name
    read_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert read_tokenizer(SPLIT_TEXT)["input_ids"] == split(SPLIT_TEXT)["input_ids"]


def test_gpt2_and_smollm_splits_are_named_from_their_steps():
    """GPT-2's split is ByteLevel's own regex; SmolLM's puts every digit apart first (llama.cpp's
    `smollm`; transformers' reader does not know it, so this is the metadata alone)."""
    from tokenizers import pre_tokenizers

    from slimtune.export_gguf import vocab

    def kind(steps):
        return vocab.tokenizer_kind(json.loads(with_pre_tokenizer(steps).backend_tokenizer.to_str()))

    assert kind([pre_tokenizers.ByteLevel(add_prefix_space=False)]) == ("gpt2", "gpt-2")
    assert kind([pre_tokenizers.Digits(individual_digits=True),
                 pre_tokenizers.ByteLevel(add_prefix_space=False)]) == ("gpt2", "smollm")


def test_a_split_llama_cpp_does_not_name_is_refused(tokenizer, tmp_path):
    from tokenizers import Regex, pre_tokenizers

    odd = with_pre_tokenizer([pre_tokenizers.Split(Regex(r"\w+|\W"), behavior="isolated"),
                              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    with pytest.raises(Exception, match=r"pre-tokenizer \(Split \+ ByteLevel\) is not one llama.cpp knows by name"):
        writer.write(random_model("qwen2", odd), odd, tmp_path / "t.gguf", "f16", progress=False)
    assert list(tmp_path.iterdir()) == []


SENTENCEPIECE_TEXT = "the cat sat on the mat, then the café said hi 42 times"


def sentencepiece_tokenizer():
    """A SentencePiece-style BPE tokenizer as transformers builds Llama 2's and Mistral 7B's (▁ for
    spaces, <0xNN> tokens for bytes it has no piece for), its merges trained here on a few lines."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    trainer_side = Tokenizer(models.BPE())
    trainer_side.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    trainer_side.train_from_iterator(["the cat sat on the mat", "then the cat said hi", "on the mat the cat"] * 10,
                                     trainers.BpeTrainer(vocab_size=120, show_progress=False))
    trained = json.loads(trainer_side.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    return LlamaTokenizer(vocab=vocab, merges=[tuple(pair) for pair in trained["merges"]], add_bos_token=True)


def test_a_sentencepiece_style_tokenizer_goes_as_llama_cpp_s_llama_model(tmp_path):
    """Mistral 7B's and Llama 2's kind: scores that merge in the merges' order, byte tokens marked,
    the space prefix; read back, the same ids (bytes for é, BOS added) and the same logits."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer(SENTENCEPIECE_TEXT, return_tensors="pt")["input_ids"]
    assert "<0xC3>" in tokenizer.convert_ids_to_tokens(ids[0]) and ids[0, 0] == tokenizer.bos_token_id
    model = random_model("mistral", tokenizer, sliding_window=None)
    path = writer.write(model, tokenizer, tmp_path / "m.gguf", "f16", "tiny-m", progress=False).path
    fields = GGUFReader(path).fields
    field = lambda key: fields[key].contents()  # noqa: E731
    assert (field("tokenizer.ggml.model"), field("tokenizer.ggml.add_space_prefix"),
            field("tokenizer.ggml.add_bos_token")) == ("llama", True, True)
    tokens, kinds = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    scores = field("tokenizer.ggml.scores")
    assert kinds[0] == 2 and kinds[1] == kinds[2] == 3 and set(kinds[3:259]) == {6}  # unknown, control, bytes
    made = ["".join(pair) for pair in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]]
    assert [scores[tokens.index(token)] for token in made[:5]] == [0.0, -1.0, -2.0, -3.0, -4.0]
    read_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert read_tokenizer(SENTENCEPIECE_TEXT)["input_ids"] == ids[0].tolist()
    assert relative_error(logits(read_back(path), ids), logits(model, ids)) < RELATIVE["f16"]


def test_a_sliding_window_caps_the_stated_context(tokenizer, tmp_path):
    from gguf import GGUFReader

    model = random_model("mistral", tokenizer, sliding_window=64)
    written = writer.write(model, tokenizer, tmp_path / "m.gguf", "f16", "m", progress=False)
    assert GGUFReader(written.path).fields["llama.context_length"].contents() == 64
    assert "sliding window" in written.notes[0]


def test_llama3_rope_factors_are_what_llama_cpp_divides_by(tokenizer):
    """llama.cpp rotates pair i by pos * base^(-2i/d) / rope_freqs[i]; Llama 3's frequencies (Meta's
    formula: long wavelengths / factor, short kept, a smooth blend between) are recomputed here."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = random_model("llama", tokenizer, rope_parameters=rope)
    layout = layouts.layout_of(model.config)
    factors = layouts.rope_frequency_factors(model, layout).double()
    d = layout.head_dim
    plain = 1.0 / 500000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    wavelength = 2 * math.pi / plain
    smooth = (64 / wavelength - 1.0) / (4.0 - 1.0)
    want = torch.where(wavelength > 64 / 1.0, plain / 8.0, torch.where(wavelength < 64 / 4.0, plain,
                       (1 - smooth) * plain / 8.0 + smooth * plain))
    torch.testing.assert_close(plain / factors, want, rtol=1e-6, atol=0)
    assert "rope_freqs.weight" in [p.name for p in layouts.plan_tensors(model, layout)]


def lora_run(tmp_path: Path, tokenizer) -> tuple[Path, Path]:
    """A LoRA run folder as training leaves it (config.yaml, adapter/) over a tiny base, its adapter
    weights random so the merge shows."""
    from slimtune.config import LoraConfig
    from slimtune.model import lora

    base = save_tiny_model(tmp_path / "base", tokenizer)
    run = tmp_path / "run"
    run.mkdir()
    settings = {"rank": 4, "alpha": 8, "targets": "all-linear"}
    (run / "config.yaml").write_text(json.dumps({"model": str(base), "method": "lora", "lora": settings,
                                                 "data": {"path": str(tmp_path / "train.jsonl")}}))
    model = load_model(base, torch.float32, torch.device("cpu"))
    lora.apply(model, LoraConfig(**settings))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if tensor.requires_grad:
                tensor.copy_(torch.randn_like(tensor) * 0.2)
    export.save_adapter(model, LoraConfig(**settings), str(base), run / "adapter")
    return run, base


def test_a_lora_run_exports_merged_through_the_cli(tokenizer, tmp_path, capsys):
    """The file holds base + adapter merged, by peft's own merge (--merge writes its folder too)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, base = lora_run(tmp_path, tokenizer)
    assert cli.main(["export", str(run), "--merge", "--gguf", str(tmp_path / "run.gguf")]) == 0
    said = capsys.readouterr().out
    assert f"written to {run / 'merged'}" in said and f"written to {tmp_path / 'run.gguf'}" in said
    plain = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    base_logits = logits(plain, ids)
    merged = PeftModel.from_pretrained(plain, str(run / "adapter")).merge_and_unload().eval()  # in place
    back = logits(read_back(tmp_path / "run.gguf"), ids)
    assert relative_error(back, logits(merged, ids)) < RELATIVE["f16"]
    assert relative_error(back, base_logits) > 0.05  # the adapter is in it: a test that can fail


def full_run(tmp_path: Path, tokenizer, family: str = "llama", **overrides) -> Path:
    """A full fine-tuning run folder as training leaves it: config.yaml and model/."""
    base = save_tiny_model(tmp_path / "base", tokenizer, family, **overrides)
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    for f in base.iterdir():
        (run / "model" / f.name).write_bytes(f.read_bytes())
    (run / "config.yaml").write_text(json.dumps({"model": str(base), "method": "full"}))
    return run


def test_a_full_run_exports_its_model_and_export_says_what_to_do_without_a_target(tokenizer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    run = full_run(tmp_path, tokenizer, seed=3)
    assert cli.main(["export", str(run), "--gguf", str(tmp_path / "full.gguf"), "--gguf-type", "bf16"]) == 0
    assert f"from {run / 'model'}" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(str(run / "model"), dtype=torch.float32).eval()
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    assert relative_error(logits(read_back(tmp_path / "full.gguf"), ids), logits(model, ids)) < RELATIVE["bf16"]
    capsys.readouterr()  # the reader's progress bar
    assert cli.main(["export", str(run)]) == 2
    assert capsys.readouterr().err.strip() == ("slimtune: error: say what to export: --merge (an HF folder),"
                                               " --gguf FILE (a GGUF file), or both.")
    assert cli.main(["export", str(run), "--out", str(tmp_path / "m")]) == 2  # --out alone: a merge was meant
    assert capsys.readouterr().err.strip() == ("slimtune: error: --out names the merged folder; add --merge, or"
                                               " leave --out out with --gguf.")
    assert cli.main(["export", str(run), "--gguf", str(run / "model" / "x.gguf")]) == 2
    assert "lies inside the run's model" in capsys.readouterr().err


def test_a_layout_llama_cpp_cannot_map_is_refused_in_one_sentence(tokenizer, tmp_path, capsys):
    run = full_run(tmp_path, tokenizer, "qwen3", attention_bias=True)
    (run / "model" / "model.safetensors").write_bytes(b"not weights")  # said before any weight loads
    assert cli.main(["export", str(run), "--gguf", str(tmp_path / "x.gguf")]) == 2
    said = capsys.readouterr().err.strip()
    assert said == ("slimtune: error: Qwen3 with attention_bias has no GGUF layout: llama.cpp's qwen3 reads no"
                    " attention biases.")
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".x.gguf*")) == []


def test_a_stopped_export_leaves_no_file_and_a_foreign_file_is_kept(demo, tmp_path, monkeypatch):
    model, tokenizer = demo
    target = tmp_path / "demo.gguf"
    calls = []

    def failing(tensor, qtype):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(tensor, qtype)

    real = writer.encode
    monkeypatch.setattr(writer, "encode", failing)
    with pytest.raises(KeyboardInterrupt):
        writer.write(model, tokenizer, target, "f16", progress=False)
    assert list(tmp_path.iterdir()) == []
    target.write_text("my notes")
    with pytest.raises(Exception, match="exists and is not a GGUF file"):
        writer.write(model, tokenizer, target, "f16", progress=False)
    assert target.read_text() == "my notes"
