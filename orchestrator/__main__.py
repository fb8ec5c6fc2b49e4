"""`python -m orchestrator ...` is the same as the `elastimesh` command."""

import sys

from orchestrator.cli import main

sys.exit(main())
