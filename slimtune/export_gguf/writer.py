"""Write a model as one GGUF file: f16, bf16 or q8_0 weights, metadata first, one tensor at a time.

The header, the metadata and every tensor's name, shape and type are written first (the gguf
package's GGUFWriter needs each tensor's size up front), then the tensors in that order, each
converted just before it is written, so no second copy of the model is ever held. The file is
written under a temporary name beside the target and renamed over it only when whole: a stopped
export leaves no half-written GGUF behind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from slimtune.errors import UserError
from slimtune.export_gguf import layout as layouts, vocab

# --gguf-type -> (llama.cpp's file type name in gguf.LlamaFileType, the 2-D weights' type name in
# gguf.GGMLQuantizationType). Norms, biases and rope factors stay float32 in every type, as llama.cpp
# keeps them.
FILE_TYPES = {"f16": ("MOSTLY_F16", "F16"), "bf16": ("MOSTLY_BF16", "BF16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0")}
MAGIC = b"GGUF"
QUANTIZE_VALUES = 2**22  # values quantized at a time (16 MiB of float32)


@dataclass
class Written:
    path: Path
    tensors: int
    bytes: int
    notes: list[str]  # what the file states differently from the model's config


def check_target(path: Path) -> None:
    """`path` may become the GGUF file: not a folder, and a file there already is a GGUF file (one
    slimtune or llama.cpp wrote); its folder exists and is writable."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--gguf '{path}' is a folder; name the file to write, e.g. {path / 'model.gguf'}.")
    if path.exists() and _magic(path) != MAGIC:
        raise UserError(f"--gguf '{path}' exists and is not a GGUF file, which slimtune does not replace;"
                        " choose another file.")
    folder = path.parent
    if not folder.is_dir():
        raise UserError(f"--gguf '{path}': its folder '{folder}' does not exist.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"--gguf '{path}' is not writable ('{folder}' does not let this user write).")


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError:
        return b""


def check_model(config, tokenizer) -> None:
    """One sentence, before any weight loads, when the model's layout or tokenizer has no GGUF form."""
    import json

    layouts.layout_of(config)
    vocab.tokenizer_kind(json.loads(tokenizer.backend_tokenizer.to_str()))


def write(model, tokenizer, path: Path, file_type: str = "f16", name: str | None = None,
          progress: bool = True) -> Written:
    """The model (merged, on the CPU) and its tokenizer as the GGUF file `path`. Everything that could
    refuse the model (its layout, its tokenizer) is checked before the file is opened."""
    import gguf

    if file_type not in FILE_TYPES:
        raise UserError(f"--gguf-type '{file_type}' is not one of {', '.join(FILE_TYPES)}.")
    path = Path(path)
    check_target(path)
    layout = layouts.layout_of(model.config)
    planned = layouts.plan_tensors(model, layout)
    writer = gguf.GGUFWriter(None, layout.arch)
    _add_metadata(writer, layout, file_type, name)
    vocab.add_tokenizer(writer, tokenizer, model.config.vocab_size)
    types = [tensor_type(p.source, file_type) for p in planned]
    for p, qtype in zip(planned, types):
        writer.add_tensor_info(p.name, tuple(p.source.shape), np.float32, encoded_bytes(p.source, qtype),
                               raw_dtype=qtype)
    total = _write_file(writer, path, planned, types, progress)
    return Written(path, len(planned), total, layout.notes)


def _add_metadata(writer, layout, file_type: str, name: str | None) -> None:
    import gguf

    writer.add_type("model")
    if name:
        writer.add_name(name)
    layouts.add_hyperparameters(writer, layout)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[file_type][0]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def tensor_type(tensor: torch.Tensor, file_type: str):
    """The GGML type a tensor is stored as: 1-D ones float32; weights the file's type, except q8_0
    rows whose length is not a multiple of its 32-value blocks, which fall back to f16."""
    import gguf

    kinds = gguf.GGMLQuantizationType
    if tensor.dim() < 2:
        return kinds.F32
    chosen = kinds[FILE_TYPES[file_type][1]]
    block = gguf.GGML_QUANT_SIZES[chosen][0]
    return chosen if tensor.shape[-1] % block == 0 else kinds.F16


def encoded_bytes(tensor: torch.Tensor, qtype) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return tensor.numel() // block * size


def encode(tensor: torch.Tensor, qtype) -> np.ndarray:
    """The tensor's bytes in `qtype`: float casts by torch (round to nearest even), q8_0 by the gguf
    package's quantizer (per 32 values: an f16 scale max|x|/127 and 32 int8)."""
    import gguf

    kinds = gguf.GGMLQuantizationType
    tensor = tensor.detach().to("cpu", torch.float32).contiguous()
    if qtype == kinds.F32:
        return tensor.numpy()
    if qtype == kinds.F16:
        return tensor.to(torch.float16).numpy()
    if qtype == kinds.BF16:
        return tensor.to(torch.bfloat16).view(torch.int16).numpy()
    rows = tensor.reshape(-1, tensor.shape[-1]).numpy()
    step = max(1, QUANTIZE_VALUES // rows.shape[1])  # the quantizer's temporaries are several times its input
    return np.concatenate([gguf.quants.quantize(rows[i:i + step], qtype) for i in range(0, len(rows), step)])


def _write_file(writer, path: Path, planned: list, types: list, progress: bool) -> int:
    """Write under a temporary name in the target's folder, then rename it over the target."""
    from tqdm.auto import tqdm

    temporary = path.with_name(f".{path.name}.{os.getpid()}.partial")
    total = 0
    try:
        writer.write_header_to_file(temporary)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        bar = tqdm(planned, desc=f"GGUF {path.name}", unit="tensor", disable=not progress, dynamic_ncols=True)
        for p, qtype in zip(bar, types):
            data = encode(p.tensor(), qtype)
            writer.write_tensor_data(data)
            total += data.nbytes
        writer.flush()
        for f in writer.fout:
            os.fsync(f.fileno())
        writer.close()
        os.replace(temporary, path)
    except BaseException:
        writer.close()
        temporary.unlink(missing_ok=True)
        raise
    return total
