"""A torchrun script that says it is running, then sleeps until it is killed (for teardown tests)."""

import os
import time

print(f"ready rank {os.environ.get('RANK')}", flush=True)
while True:
    time.sleep(0.5)
