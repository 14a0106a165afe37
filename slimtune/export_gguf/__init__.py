"""A merged model as one GGUF file, the format llama.cpp, Ollama and LM Studio read.

layout.py maps a Llama, Mistral, Qwen2 or Qwen3 model onto llama.cpp's tensor names and
hyperparameters (and refuses, in one sentence, what it cannot map); vocab.py carries the tokenizer
and chat template as GGUF metadata; writer.py writes the file (f16, bf16 or q8_0) with the gguf
package's GGUFWriter, one tensor at a time, under a temporary name that becomes the file only when
it is whole.
"""
