"""`python -m slimtune ...` (and `torchrun ... -m slimtune train run.yaml`): the command line."""

import sys

from slimtune.cli import main

sys.exit(main())
