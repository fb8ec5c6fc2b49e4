"""Run by `ray submit CLUSTER.yaml examples/train_on_head.py -- [job.toml] [--set ...]` on the head:
`elastimesh train` with those arguments on the running cluster (RAY_ADDRESS=auto: the Ray this node
runs), not on a new local Ray. Its exit code is the training's (docs/cluster.md)."""

import os
import subprocess
import sys

env = dict(os.environ, RAY_ADDRESS="auto", RAY_AUTH_MODE="token")
cmd = [sys.executable, "-m", "orchestrator", "train", "--no-progress", *sys.argv[1:]]
sys.exit(subprocess.call(cmd, env=env))
