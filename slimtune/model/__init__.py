"""The model: loading safetensors folders and the Stack view every engine uses (stack.py), a model
folder's config.json (config_json.py), 4-bit frozen linears (quant.py) and LoRA (lora.py)."""
