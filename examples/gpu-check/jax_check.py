"""Step 4: JAX start-up and one kernel (XLA loads the driver its own way).

Prints one JSON line: seconds from start to the first kernel's result, and the result.
"""
import json
import os
import time

# JAX otherwise preallocates 75% of what it sees; under a limit that is 75% of the limit.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
start = time.monotonic()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

x = jnp.arange(1 << 20, dtype=jnp.float32)
total = float((x * 2).sum())
print(json.dumps({"startup_s": time.monotonic() - start, "ok": abs(total / ((1 << 20) * ((1 << 20) - 1)) - 1) < 1e-3,
                  "device": str(jax.devices()[0]), "jax": jax.__version__}), flush=True)
