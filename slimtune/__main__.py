"""`python -m slimtune ...` (and `torchrun ... -m slimtune train run.yaml`): the command line."""

import sys

try:
    from slimtune.cli import main
except KeyboardInterrupt:  # Ctrl-C at once, before anything began: exit as cli.main would, without a word
    sys.exit(130)

sys.exit(main())
