"""After training, one module per CLI verb: `slimtune chat` (chat.py), `slimtune eval`
(evaluate.py), and what both load and generate with (inference.py)."""
