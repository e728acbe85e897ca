#!/usr/bin/env python3
"""A training loop that checkpoints when xpusense asks (HBM bandwidth stayed high).

    python examples/train_with_checkpoint.py --checkpoint-dir /tmp/ckpt [--request-dir DIR] [--steps N]

The "training step" is a little arithmetic standing in for forward/backward; the point is where
the request is handled: between steps, never inside the signal handler.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

try:
    from xpusense.client.checkpoint import DEFAULT_DIR, CheckpointRequests
except ImportError:  # the helper is one stdlib-only file: it can sit next to this script
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "client"))
    from checkpoint import DEFAULT_DIR, CheckpointRequests  # type: ignore


def train_step(state: dict) -> None:
    x = state["w"]
    for _ in range(20_000):
        x = (x * 1.000001 + 0.5) % 1000.0
    state["w"] = x
    state["step"] += 1


def save_checkpoint(state: dict, directory: str, request: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"ckpt-{state['step']:08d}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({**state, "request": request.get("id", "signal"), "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--request-dir", default=DEFAULT_DIR)
    p.add_argument("--steps", type=int, default=0, help="0: until SIGTERM")
    args = p.parse_args()

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    state = {"step": 0, "w": 1.0}
    with CheckpointRequests(args.request_dir, signal.SIGUSR1) as requests:
        print(f"training (pid {os.getpid()}); checkpoints on request into {args.checkpoint_dir}", flush=True)
        while not stop and (args.steps == 0 or state["step"] < args.steps):
            train_step(state)
            if requests.pending():                     # the safe point: between two steps
                req = requests.take()
                path = save_checkpoint(state, args.checkpoint_dir, req)
                requests.done(req, path=path)
                print(f"checkpoint {path} for request {req.get('id', '(signal)')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
