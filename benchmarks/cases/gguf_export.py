"""`slimtune export --gguf` checked where the unit tests cannot: on a real pretrained model, and in
llama.cpp itself.

1. SmolLM2-135M-Instruct (scripts/make_smollm2.py: from PyPI), in f16, bf16 and q8_0: the seconds to
   write the file and its size; on a chat prompt (the model's own template) and a plain text, the
   logits' relative error (Frobenius norm of the difference over the model's) and the share of
   positions whose most likely next token is the same, for the file read back by transformers'
   GGUF loader (about 30 s a file, which is why this is not a unit test) and run by llama.cpp; the
   token ids each tokenizes the text to against the model's; the chat template carried. With
   llama.cpp: its own q8_0 quantizer applied to our f16 file, as the yardstick for our q8_0, and the
   greedy answer to the chat question through llama.cpp's chat completion with each file.
2. The unit tests' tiny models (tests/unit/test_gguf.py: random weights, norms and biases too), f16,
   run by llama.cpp: the demo model (Llama, byte-level BPE), Qwen2 (biases, tied head), Qwen3 (q/k
   norms, head size 128 over a width of 32), Mistral with a SentencePiece-style tokenizer (scores,
   byte tokens), a Mistral whose sliding window caps the context (the text within it, where the two
   agree), and linear, yarn and Llama 3 rope scaling, each also against its twin without the
   scaling. transformers' reader checks none of llama.cpp's own rotary order, scores or rope
   scaling: llama.cpp does.

llama.cpp: `llama-cpp-python` compiles llama.cpp from source, so it is not one of slimtune's
dependencies. The case uses it when the Python named by LLAMA_CPP_PYTHON (default: this one) imports
`llama_cpp`, in a subprocess (llama.cpp's threads and memory apart from torch's): it tokenizes each
text with the file's own tokenizer and returns every position's logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _smollm2 import smollm2_folder  # benchmarks/cases/ is on the path (run.py)

ROOT = Path(__file__).resolve().parents[2]
TYPES = ("f16", "bf16", "q8_0")
PLAIN = "The capital of France is Paris. In 1889, the Eiffel Tower was 312 metres tall; today it is 330."
TINY_TEXT = "the quick brown fox, question: what is two plus two? answer: 4 hello world"
LLAMA_CPP_SCRIPT = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
path, prompts = sys.argv[1], json.loads(sys.stdin.read())
llm = Llama(model_path=path, n_ctx=512, logits_all=True, verbose=False, n_threads=1)
out = []
for text in prompts:
    ids = llm.tokenize(text.encode(), add_bos=True, special=True)
    llm.reset()
    llm.eval(ids)
    out.append({"ids": ids, "logits": np.asarray(llm.scores[: len(ids)], dtype=np.float32).tolist()})
print(json.dumps(out))
"""


QUESTION = "What is the capital of France?"
QUANTIZE_SCRIPT = r"""
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
assert llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)) == 0
"""
CHAT_SCRIPT = r"""
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, verbose=False, n_threads=1)
reply = llm.create_chat_completion(messages=[{"role": "user", "content": sys.argv[2]}], max_tokens=20, temperature=0.0)
print(reply["choices"][0]["message"]["content"])
"""


def run(quick: bool) -> dict:
    found = {"load_average": os.getloadavg(), "llama_cpp_python": _llama_python(),
             "llama_cpp": _llama_cpp_available()}
    with tempfile.TemporaryDirectory(prefix="slimtune-gguf-") as tmp:
        found["smollm2"] = smollm2(Path(tmp), TYPES[:1] if quick else TYPES)
        found["tiny"] = tiny_families(Path(tmp)) if found["llama_cpp"] is True else found["llama_cpp"]
    found["load_average_after"] = os.getloadavg()
    return found


# ---------------------------------------------------------------- SmolLM2-135M


def smollm2(folder: Path, types: tuple[str, ...]) -> dict:
    from slimtune.model.stack import load_model, load_tokenizer

    path = smollm2_folder()
    model, tokenizer = load_model(path, torch.float32, torch.device("cpu")).eval(), load_tokenizer(path)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                         tokenize=False, add_generation_prompt=True)
    prompts = {"chat": chat, "plain": PLAIN}
    reference = {name: _logits(model, tokenizer(text, return_tensors="pt")["input_ids"]) for name, text in
                 prompts.items()}
    found = {"model": "SmolLM2-135M-Instruct (pretrained, Llama layout, tied head, 9 heads / 3 KV heads)"}
    for kind in types:
        found[kind] = _smollm2_type(model, tokenizer, prompts, reference, folder / f"smollm2-{kind}.gguf", kind)
    if _llama_cpp_available() is True and "q8_0" in types:
        found["q8_0_by_llama_cpp"] = llama_cpp_own_q8_0(folder, prompts, tokenizer, reference)
        found["answers"] = answers(model, tokenizer, folder)
    return found


def llama_cpp_own_q8_0(folder: Path, prompts: dict, tokenizer, reference: dict) -> dict:
    """llama.cpp's own q8_0 quantizer (llama_model_quantize) applied to our f16 file, run alike: the
    yardstick for ours."""
    path = folder / "smollm2-q8_0-by-llama-cpp.gguf"
    subprocess.run([_llama_python(), "-c", QUANTIZE_SCRIPT, str(folder / "smollm2-f16.gguf"), str(path)], check=True,
                   capture_output=True)
    return {"file_bytes": path.stat().st_size, **llama_cpp(path, prompts, tokenizer, reference)}


def answers(model, tokenizer, folder: Path) -> dict:
    """The greedy answer to the chat question (20 tokens at most): the model's, and llama.cpp's chat
    completion (the file's own chat template) with each file."""
    messages = [{"role": "user", "content": QUESTION}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(ids["input_ids"], max_new_tokens=20, do_sample=False)
    found = {"model (float32, transformers)": tokenizer.decode(out[0, ids["input_ids"].shape[1]:],
                                                               skip_special_tokens=True)}
    for name in ("f16", "bf16", "q8_0", "q8_0-by-llama-cpp"):
        proc = subprocess.run([_llama_python(), "-c", CHAT_SCRIPT, str(folder / f"smollm2-{name}.gguf"), QUESTION],
                              capture_output=True, text=True, check=True)
        found[f"llama.cpp, {name}"] = proc.stdout.strip()
    return found


def _smollm2_type(model, tokenizer, prompts: dict, reference: dict, path: Path, kind: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimtune.export_gguf import writer

    start = time.perf_counter()
    written = writer.write(model, tokenizer, path, kind, "SmolLM2-135M-Instruct", progress=False)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    back = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    read_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    result = {"write_seconds": round(seconds, 2), "file_bytes": path.stat().st_size, "tensors": written.tensors,
              "transformers_read_seconds": round(time.perf_counter() - start, 1),
              "chat_template_carried": read_tokenizer.chat_template == tokenizer.chat_template, "transformers": {}}
    for name, text in prompts.items():
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        result["transformers"][name] = {**compare(_logits(back, ids), reference[name]),
                                        "token_ids_equal": read_tokenizer(text)["input_ids"] == ids[0].tolist()}
    del back
    result["llama_cpp"] = llama_cpp(path, prompts, tokenizer, reference) if _llama_cpp_available() is True \
        else "not run"
    return result


# ---------------------------------------------------------------- tiny families in llama.cpp


ROPES = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}
SHARPEN = 12.0  # query and key weights times this: random small weights attend almost evenly, blind to rope


def tiny_families(folder: Path) -> dict:
    """Each of the unit tests' tiny models as an f16 file, run by llama.cpp on 142 tokens. The random
    ones attend sharply (SHARPEN), so a wrong rotary order or rope scaling shows; a model with rope
    scaling is also held against its twin without it (same weights), the error a file without the
    scaling would have."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "unit")]
    import test_gguf as cases  # the unit tests' own tiny models and tokenizers

    from slimtune.model.stack import load_model, load_tokenizer

    byte_level = load_tokenizer(ROOT / "slimtune" / "demo" / "base")
    spm = cases.sentencepiece_tokenizer()
    demo = load_model(ROOT / "slimtune" / "demo" / "base", torch.float32, torch.device("cpu")).eval()
    models = {
        "demo (llama, byte-level BPE; trained weights as bundled)": (None, byte_level, {}),
        "qwen2 (biases, tied head)": ("qwen2", byte_level, {"tie_word_embeddings": True}),
        "qwen3 (q/k norms, head size 128 over a width of 32)": ("qwen3", byte_level, {"head_dim": 128,
                                                                                      "tie_word_embeddings": False}),
        "mistral (SentencePiece-style BPE)": ("mistral", spm, {"sliding_window": None}),
        "mistral (sliding window 256 caps the context of 512; the text is within it)": (
            "mistral", byte_level, {"sliding_window": 256, "max_position_embeddings": 512}),
        "llama (linear rope x4)": ("llama", byte_level, {"rope_parameters": ROPES["linear"]}),
        "qwen2 (yarn rope x4 over 64)": ("qwen2", byte_level, {"rope_parameters": ROPES["yarn"]}),
        "llama (yarn rope x4 over 64)": ("llama", byte_level, {"rope_parameters": ROPES["yarn"]}),
        "llama (llama3 rope, factors as rope_freqs)": ("llama", byte_level, {"rope_parameters": ROPES["llama3"]}),
    }
    found = {}
    for index, (name, (family, tokenizer, overrides)) in enumerate(models.items()):
        model = demo if family is None else _sharp(cases.random_model(family, tokenizer, **overrides))
        text = (cases.SENTENCEPIECE_TEXT if tokenizer is spm else TINY_TEXT) * 3
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        found[name] = _tiny(model, tokenizer, text, folder / f"tiny-{index}.gguf")
        if "rope_parameters" in overrides:
            plain = {k: v for k, v in overrides.items() if k != "rope_parameters"}
            twin = _sharp(cases.random_model(family, tokenizer, **plain))  # the same seed: the same weights
            found[name]["without_the_scaling"] = compare(torch.tensor(found[name].pop("logits")), _logits(twin, ids))
        found[name].pop("logits", None)
    return found


def _tiny(model, tokenizer, text: str, path: Path) -> dict:
    from slimtune.export_gguf import writer

    written = writer.write(model, tokenizer, path, "f16", path.stem, progress=False)
    reference = {"text": _logits(model, tokenizer(text, return_tensors="pt")["input_ids"])}
    return {"notes": written.notes, **llama_cpp(path, {"text": text}, tokenizer, reference, keep_logits=True)["text"]}


def _sharp(model):
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.k_proj.weight.mul_(SHARPEN)
    return model


# ---------------------------------------------------------------- helpers


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0]


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    return {"relative_error": round(((got - want).norm() / want.norm()).item(), 6),
            "top1_agreement": round((got.argmax(-1) == want.argmax(-1)).float().mean().item(), 4),
            "positions": want.shape[0]}


def _llama_python() -> str:
    return os.environ.get("LLAMA_CPP_PYTHON", sys.executable)


def _llama_cpp_available() -> bool | str:
    probe = subprocess.run([_llama_python(), "-c", "import llama_cpp"], capture_output=True)
    if probe.returncode != 0:
        return f"not run: {_llama_python()} cannot import llama_cpp (llama-cpp-python, which compiles llama.cpp)"
    return True


def llama_cpp(path: Path, prompts: dict, tokenizer, reference: dict, keep_logits: bool = False) -> dict:
    """Each prompt tokenized and run by llama.cpp: its ids against the tokenizer's, and where they are
    the same, its logits against `reference` position by position (and kept, with keep_logits)."""
    proc = subprocess.run([_llama_python(), "-c", LLAMA_CPP_SCRIPT, str(path)], capture_output=True, text=True,
                          input=json.dumps(list(prompts.values())), check=True)
    found = {}
    for (name, text), got in zip(prompts.items(), json.loads(proc.stdout)):
        want_ids = tokenizer(text)["input_ids"]
        found[name] = {"token_ids_equal": got["ids"] == want_ids}
        if got["ids"] == want_ids:
            found[name].update(compare(torch.tensor(got["logits"]), reference[name]))
            if keep_logits:
                found[name]["logits"] = got["logits"]
        else:
            found[name].update(ids=got["ids"], want_ids=want_ids)
    return found
